"""`python -m eqx_logs plot RUN_DIR`: the scalar curves of JSONL runs, drawn into
`RUN_DIR/curves.png` (or `-o IMAGE`)."""

import argparse
import difflib
import fnmatch
import math
import os
import re
import shlex
import sys
from collections.abc import Sequence

from ._instrument import key_pattern
from ._spelling import closest
from .loggers._jsonl import read_jsonl

Curves = dict[str, dict[str, tuple[list[float], list[float]]]]


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):  # (`read_jsonl` reads NaN and infinities as floats)
        return float(value)
    if isinstance(value, list) and len(value) == 1:
        return _number(value[0])
    return None


def find_runs(path: str) -> list[str]:
    """The `.jsonl` files at `path` (a file, or a directory searched recursively)."""
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        found += [os.path.join(root, f) for f in sorted(files) if f.endswith(".jsonl")]
    return found


def default_output(path: str) -> str:
    """Where the image goes without `-o`: into the run's directory (`path/curves.png`), or for
    a `.jsonl` file beside it (`logs.jsonl` gives `logs.png`), not into the working
    directory."""
    if os.path.isfile(path):
        return os.path.splitext(path)[0] + ".png"
    return os.path.join(path, "curves.png")


def key_matches(key: str, pattern: str) -> bool:
    """Whether `key` matches `pattern`, as `fnmatch` (`*`, `?`, `[abc]` a character class) or
    as a glob whose only wildcards are `*` and `?`, brackets matching themselves: `layers[0]/*`
    matches `layers[0]/rms` (the keys `eqx_logs.instrument` logs)."""
    if fnmatch.fnmatchcase(key, pattern):
        return True
    return re.fullmatch(key_pattern(pattern), key, re.DOTALL) is not None


def _key_regex(pattern: str) -> str:
    """A regular expression of the keys `pattern` matches (`key_matches`), whole."""
    return f"{fnmatch.translate(pattern)}|{key_pattern(pattern)}"


def _overrides(file: str) -> list[str] | None:
    """The Hydra overrides of the run that wrote `file` (`.hydra/overrides.yaml` beside it),
    or None where there is no such file."""
    path = os.path.join(os.path.dirname(os.path.abspath(file)), ".hydra", "overrides.yaml")
    if not os.path.isfile(path):
        return None
    from omegaconf import OmegaConf

    overrides = OmegaConf.to_container(OmegaConf.load(path))
    return [str(o) for o in overrides] if isinstance(overrides, list) else None


def run_names(files: Sequence[str]) -> dict[str, str]:
    """A name for each file's run: the Hydra overrides that differ between the runs (those of
    a multirun's sweep: `logging.interval=10`), else the file's path below the files' common
    directory; `""` for a lone file."""
    if len(files) <= 1:
        return {f: "" for f in files}
    overrides = {f: _overrides(f) for f in files}
    if all(o is not None for o in overrides.values()):
        common = set.intersection(*(set(o) for o in overrides.values()))
        names = {f: " ".join(x for x in o if x not in common) for f, o in overrides.items()}
        if len(set(names.values())) == len(files):
            return names
    root = os.path.commonpath([os.path.abspath(f) for f in files])
    return {f: os.path.relpath(os.path.abspath(f), root) for f in files}


def load_curves(
    files: Sequence[str], keys: Sequence[str] = ("*",), step: str = "step"
) -> tuple[Curves, set[str], set[str]]:
    """`curves[key][label] = (xs, ys)` for every scalar key matching one of `keys`
    (`key_matches`), one label per run (`run_names`, and the logger's run index where not 0);
    x is the record's `step`, or its index among the key's records. Also returns the keys
    skipped because their values are not scalars, and the keys plotted against the index
    because their records have no `step`."""
    curves: Curves = {}
    skipped: set[str] = set()
    unstepped: set[str] = set()
    names = run_names(files)
    for file in files:
        name = names[file]
        for record in read_jsonl(file):
            key = record.get("key")
            if not isinstance(key, str) or not any(key_matches(key, k) for k in keys):
                continue
            y = _number(record.get("value"))
            if y is None:
                skipped.add(key)
                continue
            run = record.get("run", 0)
            label = " ".join(p for p in (name, f"run {run}" if run else "") if p) or "run 0"
            xs, ys = curves.setdefault(key, {}).setdefault(label, ([], []))
            x = _number(record.get(step))
            if x is None:
                unstepped.add(key)
            xs.append(float(len(xs)) if x is None else x)
            ys.append(y)
    return curves, skipped - set(curves), unstepped


def no_match(files: Sequence[str], keys: Sequence[str]) -> str:
    """The error for patterns that match no scalar key: the scalar keys the files hold, and
    how to pick some (the key closest to the first pattern, and a `prefix/*` pattern)."""
    scalar, other = set(), set()
    for f in files:
        for r in read_jsonl(f):
            if isinstance(r.get("key"), str):
                (other if _number(r.get("value")) is None else scalar).add(r["key"])
    asked = " ".join(f"-k {shlex.quote(k)}" for k in keys)
    where = f"{len(files)} file(s)" if len(files) > 1 else files[0]
    if not scalar:
        held = f" (its keys: {', '.join(sorted(other))})" if other else ""
        return f"error: no scalar values in {where}{held}"
    present = sorted(scalar)
    shown = ", ".join(present[:40]) + (f", ... ({len(present) - 40} more)" if present[40:] else "")
    # the key the first pattern is a likely typo of (the policy's rule), else one like it
    close = closest(keys[0], present, _key_regex)
    close = close or (difflib.get_close_matches(keys[0], present, n=1, cutoff=0.5) or present)[0]
    examples = [f"-k {shlex.quote(close)}"]
    prefix = next((k.split("/")[0] for k in present if "/" in k), None)
    if prefix is not None:
        examples.append(f"-k {shlex.quote(prefix + '/*')}")
    return (
        f"error: no scalar key matches {asked} in {where}; its scalar keys:\n  {shown}\n"
        f"pick some with -k (repeatable; '*' and '?' are wildcards), e.g. {', '.join(examples)}; "
        "without -k every key is plotted"
    )


def plot(
    curves: Curves,
    output: str,
    title: str | None = None,
    unstepped: set[str] = frozenset(),
    step: str = "step",
    logy: bool = False,
) -> None:
    """Draw one panel per key, a line per run, into `output` (any format matplotlib writes);
    x is `step`, or for the keys in `unstepped` the index of the record; y is the key's last
    `/`-part (`rms` of `layers[0]/rms`), on a log scale with `logy` (a symmetric one for a key
    with values <= 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(curves)
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, (xs, ys) in sorted(curves[key].items()):
            ax.plot(xs, ys, label=label, linewidth=1.2)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(f"record (no {step})" if key in unstepped else step)
        ax.set_ylabel(key.rsplit("/", 1)[-1])
        if logy:
            positive = all(y > 0 for _, ys in curves[key].values() for y in ys)
            ax.set_yscale("log" if positive else "symlog")
        ax.grid(alpha=0.3)
        if len(curves[key]) > 1:
            ax.legend(fontsize=7)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="python -m eqx_logs", description="Tools for eqx_logs runs."
    )
    parser.add_argument("--version", action="version", version=f"eqx_logs {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "plot",
        help="draw the scalar curves of JSONL runs (pip install '.[plot]' from the checkout)",
    )
    p.add_argument("run_dir", help="a .jsonl file, or a directory searched for them")
    p.add_argument(
        "-o",
        "--output",
        help="the image (default: RUN_DIR/curves.png; for a .jsonl file, the file's name with "
        ".png, beside it)",
    )
    p.add_argument(
        "-k",
        "--key",
        action="append",
        dest="keys",
        metavar="PATTERN",
        help="a key pattern to plot, repeatable (-k loss -k 'grad/*'; default: all keys): '*' "
        "matches any characters, '?' one; a key matches a pattern as fnmatch ('[ab]' a "
        "character class) or with '[' and ']' matching themselves, so 'layers[0]/*' plots the "
        "statistics eqx_logs.instrument logged for layers[0]. Quote patterns in the shell.",
    )
    p.add_argument("--logy", action="store_true", help="a log scale for the values")
    p.add_argument(
        "--step",
        default="step",
        help="the step name for the x axis (records without it: their index)",
    )
    args = parser.parse_args(argv)
    keys = args.keys or ["*"]
    output = args.output or default_output(args.run_dir)

    files = find_runs(args.run_dir)
    if not files:
        print(f"error: no .jsonl files in {args.run_dir!r}", file=sys.stderr)
        return 2
    try:
        curves, skipped, unstepped = load_curves(files, keys, args.step)
    except ValueError as e:  # a file that is not a JsonlLogger's, named by the reader
        print(f"error: {e}", file=sys.stderr)
        return 2
    if skipped:
        names = ", ".join(sorted(skipped))
        print(f"not plotted (values are not scalars): {names}", file=sys.stderr)
    if not curves:
        print(no_match(files, keys), file=sys.stderr)
        return 2
    try:
        plot(curves, output, args.run_dir, unstepped, args.step, args.logy)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != "matplotlib":
            raise
        print(
            "error: plot needs matplotlib: pip install '.[plot]' from the eqx_logs checkout "
            "(or pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    n = sum(len(c) for c in curves.values())
    print(f"wrote {output}: {len(curves)} keys, {n} curves from {len(files)} file(s)")
    labels = sorted({label for c in curves.values() for label in c})
    if len(labels) > 1:
        print("runs: " + ", ".join(labels))
    return 0
