"""`python -m eqx_logs plot RUN_DIR -o curves.png`: the scalar curves of JSONL runs."""

import argparse
import fnmatch
import math
import os
import re
import sys
from collections.abc import Sequence

from ._instrument import key_pattern
from .loggers._jsonl import read_jsonl

Curves = dict[str, dict[str, tuple[list[float], list[float]]]]


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if value in ("nan", "inf", "-inf"):
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


def key_matches(key: str, pattern: str) -> bool:
    """Whether `key` matches `pattern`, as `fnmatch` (`*`, `?`, `[abc]` a character class) or
    as a glob whose only wildcards are `*` and `?`, brackets matching themselves: `layers[0]/*`
    matches `layers[0]/rms` (the keys `eqx_logs.instrument` logs)."""
    if fnmatch.fnmatchcase(key, pattern):
        return True
    return re.fullmatch(key_pattern(pattern), key, re.DOTALL) is not None


def load_curves(
    files: Sequence[str], keys: Sequence[str] = ("*",), step: str = "step"
) -> tuple[Curves, set[str], set[str]]:
    """`curves[key][label] = (xs, ys)` for every scalar key matching one of `keys`
    (`key_matches`), one label per file and run; x is the record's `step`, or its index among
    the key's records. Also returns the keys skipped because their values are not scalars, and
    the keys plotted against the index because their records have no `step`."""
    curves: Curves = {}
    skipped: set[str] = set()
    unstepped: set[str] = set()
    common = os.path.commonpath([os.path.abspath(f) for f in files]) if len(files) > 1 else ""
    for file in files:
        name = os.path.relpath(os.path.abspath(file), common) if common else ""
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


def plot(
    curves: Curves,
    output: str,
    title: str | None = None,
    unstepped: set[str] = frozenset(),
    step: str = "step",
) -> None:
    """Draw one panel per key, a line per run, into `output` (any format matplotlib writes);
    x is `step`, or for the keys in `unstepped` the index of the record."""
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
    parser = argparse.ArgumentParser(
        prog="python -m eqx_logs", description="Tools for eqx_logs runs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "plot",
        help="draw the scalar curves of JSONL runs (pip install '.[plot]' from the checkout)",
    )
    p.add_argument("run_dir", help="a .jsonl file, or a directory searched for them")
    p.add_argument("-o", "--output", default="curves.png", help="the image (default: %(default)s)")
    p.add_argument(
        "-k",
        "--keys",
        nargs="+",
        default=["*"],
        help="key patterns to plot (default: all): '*' matches any characters, '?' one; a key "
        "matches a pattern as fnmatch ('[ab]' a character class) or with '[' and ']' matching "
        "themselves, so 'layers[0]/*' plots the statistics eqx_logs.instrument logged for "
        "layers[0]. Quote patterns in the shell.",
    )
    p.add_argument(
        "--step",
        default="step",
        help="the step name for the x axis (records without it: their index)",
    )
    args = parser.parse_args(argv)

    files = find_runs(args.run_dir)
    if not files:
        print(f"error: no .jsonl files in {args.run_dir!r}", file=sys.stderr)
        return 2
    curves, skipped, unstepped = load_curves(files, args.keys, args.step)
    if skipped:
        names = ", ".join(sorted(skipped))
        print(f"not plotted (values are not scalars): {names}", file=sys.stderr)
    if not curves:
        print(f"error: no scalar keys matching {args.keys} in {files}", file=sys.stderr)
        return 2
    plot(curves, args.output, title=args.run_dir, unstepped=unstepped, step=args.step)
    n = sum(len(c) for c in curves.values())
    print(f"wrote {args.output}: {len(curves)} keys, {n} curves from {len(files)} file(s)")
    return 0
