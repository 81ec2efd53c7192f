"""Whether a name the user wrote is a likely typo of one the program has: the one rule for the
policy's `tags`, `exclude` and `rules` (warned after a run) and the plot command's `-k`."""

import difflib
import re
from collections.abc import Callable, Iterable

RATIO = 0.8  # difflib's ratio from which two names count as spelt alike
LONG = 4  # characters a word needs for one edit to count: `"lr"` is no typo of `"rl"`
SWAP = 2  # how far apart two swapped characters may be: side by side, or one between
WILDCARDS = "*?"


def closest(
    word: str, among: Iterable[str], regex: Callable[[str], str] | None = None
) -> str | None:
    """The name in `among` that `word` is most likely a typo of, or None. In that order:

    - the same but for case (`"Debug"` for `"debug"`);
    - for a word of 4 characters or more (not counting wildcards), one edit away: a
        character too many, one missing, one replaced, or two swapped, side by side or with
        one between (`"trian"` for `"train"`, `"degub"` for `"debug"`, `"grads/*"` for
        `"grad/w"`);
    - spelt alike: difflib's ratio 0.8 or more (the highest), which also takes longer names
        a few edits apart (difflib alone misses a swap in a short name: `"degub"` is 0.6).

    A name that merely shares a prefix (`"window"` beside `"window_max"`) is none.

    **Arguments:**

    - `word`: what the user wrote (a tag, or with `regex` a pattern).
    - `among`: the names the program has (the tags logged, the keys kept).
    - `regex`: for a pattern, `regex(pattern)`, the regular expression of the names it
        matches, whole (`fnmatch.translate`); `None`: `word` is a plain name.

    **Returns:**

    The first name of `among` found by the earliest of the rules above, or None.

    ```python
    closest("degub", ["debug", "train"])  # "debug"
    closest("grads/*", ["grad/w", "loss"], fnmatch.translate)  # "grad/w"
    ```
    """
    among = list(among)
    if regex is None:
        lower = word.lower()
        found = next((name for name in among if name.lower() == lower), None)
        if found is None and len(word) >= LONG:
            found = next((name for name in among if _one_edit(word, name)), None)
    else:  # one expression for all of a pattern's edits: one match per name
        case = _either([word.lower()], regex)
        found = next((name for name in among if case.fullmatch(name.lower())), None)
        if found is None and sum(c not in WILDCARDS for c in word) >= LONG:
            edits = _either(_pattern_edits(word), regex)
            found = next((name for name in among if edits.fullmatch(name)), None)
    if found is not None:
        return found
    close = difflib.get_close_matches(word, among, n=1, cutoff=RATIO)
    return close[0] if close else None


def _either(patterns: Iterable[str], regex: Callable[[str], str]) -> re.Pattern:
    return re.compile("|".join(f"(?:{regex(p)})" for p in patterns), re.DOTALL)


def _one_edit(a: str, b: str) -> bool:
    """Whether `a` and `b` differ by at most one edit: a character inserted, deleted or
    replaced, or two characters swapped (Damerau's transposition, here also of two with one
    between them: `"degub"` for `"debug"` as well as `"trian"` for `"train"`)."""
    if len(a) == len(b):
        differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if len(differ) == 2:
            i, j = differ
            return j - i <= SWAP and a[i] == b[j] and a[j] == b[i]
        return len(differ) <= 1
    if abs(len(a) - len(b)) > 1:
        return False
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((i for i, (x, y) in enumerate(zip(short, long)) if x != y), len(short))
    return short[i:] == long[i + 1 :]


def _swaps(n: int) -> Iterable[tuple[int, int]]:
    """The pairs of positions (of `n`) whose characters a typo swaps: at most `SWAP` apart."""
    return ((i, j) for i in range(n) for j in range(i + 1, min(i + SWAP + 1, n)))


def _pattern_edits(pattern: str) -> Iterable[str]:
    """The patterns one edit from `pattern`, edited as text (a character deleted, two
    swapped) or standing for one (`?` for a character replaced, or missing): each matches
    what `pattern` would match but for that typo. Those left with no character but wildcards
    (matching nearly everything) are left out."""
    n = len(pattern)
    edits = [pattern[:i] + pattern[i + 1 :] for i in range(n)]
    for i, j in _swaps(n):
        if pattern[i] != pattern[j]:
            edits.append(
                pattern[:i] + pattern[j] + pattern[i + 1 : j] + pattern[i] + pattern[j + 1 :]
            )
    edits += [pattern[:i] + "?" + pattern[i + 1 :] for i in range(n)]
    edits += [pattern[:i] + "?" + pattern[i:] for i in range(n + 1)]
    return (e for e in dict.fromkeys(edits) if e.strip(WILDCARDS))
