"""`python -m eqx_logs plot RUN_DIR`: the curves of JSONL runs, drawn into
`RUN_DIR/curves.png` (or `-o IMAGE`)."""

import argparse
import difflib
import fnmatch
import math
import os
import re
import shlex
import sys
import warnings
from collections.abc import Sequence, Set

from ._instrument import key_pattern
from ._spelling import closest
from ._stats import STATS
from .loggers._jsonl import read_jsonl

Curves = dict[str, dict[str, tuple[list[float], list]]]
# `lines[key][(run, lane)] = (xs, ys)`: `lane` names a device, "" for a key of one value; for
# a key whose records hold a vector each (lane `ELEMENTS`), each y is the list of its numbers
Lines = dict[str, dict[tuple[str, str], tuple[list[float], list]]]
ELEMENTS = "elements"  # the lane of a vector-valued key (per-env returns under a `jax.vmap`)


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
        dirs.sort(key=_natural)  # a multirun's jobs 0, 1, ..., 9, 10 in order
        found += [
            os.path.join(root, f) for f in sorted(files, key=_natural) if f.endswith(".jsonl")
        ]
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


def _floats(value: object) -> list[float] | None:
    """The numbers of a (nested) list, flattened; None where anything else is in it."""
    if not isinstance(value, list):
        number = _number(value)
        return None if number is None else [number]
    out: list[float] = []
    for v in value:
        numbers = _floats(v)
        if numbers is None:
            return None
        out += numbers
    return out


def _per_device(value: object, steps: object) -> list[tuple[float | None, float]] | None:
    """`(x, y)` for each device of a record that holds one value per device (`value` and its
    step lists of the same length, as a spool keeping a key per device writes them), else
    None: a vector logged at one step is not one value per device."""
    ys = _floats(value) if isinstance(value, list) else None
    xs = _floats(steps) if isinstance(steps, list) else None
    if ys is None or xs is None or len(xs) != len(ys) or len(ys) < 2:
        return None
    return list(zip(xs, ys))


def _natural(text: str) -> list[object]:
    """A sort key that orders the numbers in `text` by value: `layers[2]` before `layers[10]`."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


# a quantile's name in a reduction's output: "p" + f"{100 * q:g}" (`eqx_logs.Quantiles`)
QUANTILE = re.compile(r"p(\d+(\.\d*)?|\.\d+)(e[+-]?\d+)?")


def quantile(name: str) -> float | None:
    """The quantile a name such as `p50` or `p99.9` stands for (0.5, 0.999), else None."""
    return float(name[1:]) / 100 if QUANTILE.fullmatch(name) else None


# the output of `eqx_logs.NoiseScale`, a dict of these scalars
NOISE_SCALE = frozenset({"b_simple", "trace", "grad_sq"})


def expand(key: str, value: object) -> list[tuple[str, object]]:
    """A record's `(key, value)` pairs: a dict holding quantiles (what `eqx_logs.Quantiles`
    gives, `{"p50": ..., "p90": ...}`) or a noise scale's terms (`eqx_logs.NoiseScale`'s
    `{"b_simple": ..., "trace": ..., "grad_sq": ...}`) is one key per entry, `loss/p50` and
    `loss/p90` (as the backends that take scalars only write it); any other value (another
    dict too) is the key itself."""
    if isinstance(value, dict) and (
        any(quantile(str(name)) is not None for name in value) or set(value) == NOISE_SCALE
    ):
        return [(f"{key}/{name}", v) for name, v in value.items()]
    return [(key, value)]


def _matching(file: str, keys: Sequence[str]):
    """The records of `file` (`expand`ed) whose key matches one of `keys`, or whose key before
    expanding does (`-k loss` plots `loss/p50`)."""
    for record in read_jsonl(file):
        name = record.get("key")
        if not isinstance(name, str):
            continue
        whole = any(key_matches(name, k) for k in keys)
        for key, value in expand(name, record.get("value")):
            if whole or any(key_matches(key, k) for k in keys):
                yield {**record, "key": key, "value": value}


def read_lines(
    files: Sequence[str], keys: Sequence[str] = ("*",), step: str = "step"
) -> tuple[Lines, set[str], set[str]]:
    """`lines[key][(run, lane)] = (xs, ys)` for every key matching one of `keys`
    (`key_matches`) whose values are numbers: one line per run (`run_names`, and the logger's
    run index where not 0), and where a key holds one value per device, one per device too
    (`lane` is `device <i>`, or for records that `logger.tap` wrote per device, the axis
    index that tells them apart: `d=2`; `""` for a scalar key). x is the record's `step`, or
    its index among the line's records. A key whose records each hold several numbers at one
    step (a vector or an array, such as the returns of the environments a `jax.vmap` steps)
    has one line per run in the lane `ELEMENTS`, each y the list of the record's numbers
    (flattened). Also returns the keys skipped because their values are not numbers
    (pytrees, text), and the keys plotted against the index because their records have no
    `step`."""
    lines: Lines = {}
    skipped: set[str] = set()
    unstepped: set[str] = set()
    names = run_names(files)
    rank: dict[str, tuple[int, int]] = {}  # the runs' order: by file, then by run index
    for n, file in enumerate(files):
        # (key, run) -> [(x, y, the record's other integer fields)] of its scalar records
        scalars: dict[tuple[str, str], list[tuple[float | None, float, dict]]] = {}
        # (key, run, lane) -> [(x, y)]: y a number, or a vector's numbers (lane `ELEMENTS`)
        devices: dict[tuple[str, str, str], list[tuple[float | None, float | list[float]]]] = {}
        for record in _matching(file, keys):
            key = record["key"]
            run = record.get("run", 0)
            label = " ".join(p for p in (names[file], f"run {run}" if run else "") if p)
            label = label or "run 0"
            rank.setdefault(label, (n, run if isinstance(run, int) else 0))
            y = _number(record.get("value"))
            if y is not None:
                other = {
                    k: v
                    for k, v in record.items()
                    if k not in ("run", "key", "value", "count", step)
                    and isinstance(v, int)
                    and not isinstance(v, bool)
                }
                scalars.setdefault((key, label), []).append((_number(record.get(step)), y, other))
                continue
            points = _per_device(record.get("value"), record.get(step))
            if points is not None:
                for i, point in enumerate(points):
                    devices.setdefault((key, label, f"device {i}"), []).append(point)
                continue
            elements = _floats(record.get("value"))
            if not elements:  # (a pytree, text, an empty list)
                skipped.add(key)
                continue
            x = _number(record.get(step))
            devices.setdefault((key, label, ELEMENTS), []).append((x, elements))
        for (key, label), rows in scalars.items():
            for lane, points in _split_lanes(rows).items():
                devices[(key, label, lane)] = points
        for (key, label, lane), points in devices.items():
            xs, ys = lines.setdefault(key, {}).setdefault((label, lane), ([], []))
            for x, y in points:
                if x is None:
                    unstepped.add(key)
                xs.append(float(len(xs)) if x is None else x)
                ys.append(y)
    for key, by_line in lines.items():  # runs in their files' order, devices by number
        order = sorted(by_line, key=lambda line: (rank[line[0]], _natural(line[1])))
        lines[key] = {line: by_line[line] for line in order}
    return lines, skipped - set(lines), unstepped


def _split_lanes(
    rows: list[tuple[float | None, float, dict]],
) -> dict[str, list[tuple[float | None, float]]]:
    """The scalar records of one key and run, split into lines by the fields that tell apart
    records at the same step (the axis indices `logger.tap` writes for each device's event,
    `{"d": 2, ...}`); one line `""` where no step repeats."""
    seen: dict[float | None, list[dict]] = {}
    for x, _, other in rows:
        seen.setdefault(x, []).append(other)
    fields = sorted(
        {
            f
            for x, at_x in seen.items()
            if x is not None and len(at_x) > 1
            for f in set().union(*at_x)
            if len({o.get(f) for o in at_x}) > 1
        }
    )
    if not fields:
        return {"": [(x, y) for x, y, _ in rows]}
    out: dict[str, list[tuple[float | None, float]]] = {}
    for x, y, other in rows:
        lane = ",".join(f"{f}={other.get(f)}" for f in fields)
        out.setdefault(lane, []).append((x, y))
    return out


def load_curves(
    files: Sequence[str], keys: Sequence[str] = ("*",), step: str = "step"
) -> tuple[Curves, set[str], set[str]]:
    """`read_lines` with one label per line, `curves[key][label] = (xs, ys)`: the run's name,
    and for a key with one value per device, the device after it (`run 0 device 1`)."""
    lines, skipped, unstepped = read_lines(files, keys, step)
    curves = {
        key: {" ".join(p for p in line if p): xy for line, xy in by_line.items()}
        for key, by_line in lines.items()
    }
    return curves, skipped, unstepped


def no_match(files: Sequence[str], keys: Sequence[str], step: str = "step") -> str:
    """The error for patterns that match no key of numbers: the keys of numbers the files hold
    (scalars, one value per device, vectors), and how to pick some (the key closest to the first
    pattern, and a `prefix/*` pattern)."""
    scalar, other = set(), set()
    for f in files:
        for r in _matching(f, ["*"]):  # (scalars, a value per device, vectors, quantiles)
            (scalar if _floats(r["value"]) else other).add(r["key"])
    asked = " ".join(f"-k {shlex.quote(k)}" for k in keys)
    where = f"{len(files)} file(s)" if len(files) > 1 else files[0]
    if not scalar:
        held = f" (its keys: {', '.join(sorted(other))})" if other else ""
        return f"error: no numbers in {where}{held}"
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
        f"error: no key of numbers matches {asked} in {where}; its keys of numbers:\n"
        f"  {shown}\n"
        f"pick some with -k (repeatable; '*' and '?' are wildcards), e.g. {', '.join(examples)}; "
        "without -k every key is plotted"
    )


def _statistic(key: str) -> tuple[str, str] | None:
    """`(where, statistic)` of a key `eqx_logs.instrument` or `log_stats` logs:
    `layers[0]/grad/rms` gives `("layers[0]/grad", "rms")`; None for another key."""
    where, _, stat = key.rpartition("/")
    return (where, stat) if where and stat in STATS else None


def arrange(keys: Sequence[str]) -> list[list[str | None]]:
    """The panels' places, row by row (`None`: an empty place). The training metrics come
    first, the loss leading; then the statistics (`_statistic`), grouped by where they were
    taken, layer by layer (`layers[2]` before `layers[10]`, each layer's gradient after its
    output): a row per layer and a column per statistic where the layers have three or more,
    otherwise in rows of two to four panels."""
    stats: dict[str, list[str]] = {}
    metrics: list[str] = []
    for key in keys:
        found = _statistic(key)
        if found:
            stats.setdefault(found[0], []).append(key)
        else:
            metrics.append(key)
    metrics.sort(key=lambda k: ("loss" not in k.rsplit("/", 1)[-1].lower(), _natural(k)))
    wheres = sorted(stats, key=lambda w: (_natural(w.removesuffix("/grad")), w.endswith("/grad")))
    names = [s for s in STATS if any(_statistic(k)[1] == s for w in wheres for k in stats[w])]
    if len(names) < 3:  # a few statistics (or none): no table of them
        flow = metrics + [k for w in wheres for k in sorted(stats[w], key=_stat_order)]
        cols = {1: 1, 2: 2, 3: 3, 4: 2}.get(len(flow), 3 if len(flow) <= 12 else 4)
        return [
            flow[i : i + cols] + [None] * (cols - len(flow[i : i + cols]))
            for i in range(0, len(flow), cols)
        ]
    cols = len(names)
    rows: list[list[str | None]] = []
    for i in range(0, len(metrics), cols):
        row: list[str | None] = list(metrics[i : i + cols])
        rows.append(row + [None] * (cols - len(row)))
    for w in wheres:
        row = [None] * cols
        for k in stats[w]:
            row[names.index(_statistic(k)[1])] = k
        rows.append(row)
    return rows


def _stat_order(key: str) -> int:
    return STATS.index(key.rsplit("/", 1)[-1])


def _run_colors(runs: Sequence[str]) -> dict[str, object]:
    """A colour for each run: matplotlib's ten defaults, then twenty, then a colour map."""
    import matplotlib

    if len(runs) <= 10:
        colors = [f"C{i}" for i in range(len(runs))]
    elif len(runs) <= 20:
        colors = list(matplotlib.colormaps["tab20"].colors)
    else:
        cmap = matplotlib.colormaps["viridis"]
        colors = [cmap(i / (len(runs) - 1)) for i in range(len(runs))]
    return dict(zip(runs, colors))


MAX_DEVICE_LINES = 8  # a run with more devices (or several runs) draws their mean and range
MARKED = 15  # a line of this many points or fewer marks them (two points are not a trend)


def _values(ys: Sequence) -> list[float]:
    """The numbers of a line's ys, a vector's elements (lane `ELEMENTS`) flattened."""
    return [v for y in ys for v in (y if isinstance(y, list) else (y,))]


def _nonfinite(y: float | list[float]) -> bool:
    return not all(math.isfinite(v) for v in (y if isinstance(y, list) else (y,)))


def _first_nonfinite(key: str, xs: Sequence[float], ys: Sequence) -> tuple[float, str] | None:
    """`(x, what)` of the first step (the least x) at which a line of `key` holds a NaN or an
    infinity (`what`: "NaN", "inf", "-inf"; for a vector, any of its elements), or, for the
    count of non-finite elements `eqx_logs.instrument` and `log_stats` log (`.../nonfinite`),
    where that count is first above 0; None where there is none."""
    count = key.rsplit("/", 1)[-1] == "nonfinite"
    bad = [
        (x, y)
        for x, y in zip(xs, ys)
        if math.isfinite(x) and (_nonfinite(y) or (count and any(v > 0 for v in _values([y]))))
    ]
    if not bad:
        return None
    x = min(x for x, _ in bad)
    values = [v for x_, y in bad if x_ == x for v in _values([y]) if not math.isfinite(v)]
    if not values:
        return x, "non-finite"
    kinds = {"NaN" if math.isnan(v) else f"{v:g}" for v in values}
    return x, kinds.pop() if len(kinds) == 1 else "non-finite"


def _span(xs: Sequence[float]) -> tuple[float, float] | None:
    """The x limits that show every x of `xs` (the first to the last step, those of NaN values
    too), a margin on either side; None without a finite x."""
    finite = [x for x in xs if math.isfinite(x)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    pad = 0.03 * (hi - lo) or 0.5 * max(abs(lo), 1.0)
    if all(float(x).is_integer() for x in finite):
        pad = max(pad, 0.5)  # (a marker at the first or last step, whole)
    return lo - pad, hi + pad


def bands(lines: Lines) -> dict[str, list[tuple[float, str]]]:
    """The keys drawn as a band: `{panel: [(q, key), ...]}`, q ascending, for each key whose
    sibling keys are two or more quantiles (`loss/p10`, `loss/p50`, `loss/p90`, as
    `eqx_logs.Quantiles` gives them) of one value each per run (no devices, no vectors). The
    panel is named by their parent key (`loss`; `loss (quantiles)` where `loss` is a key too)."""
    found: dict[str, list[tuple[float, str]]] = {}
    for key, by_line in lines.items():
        parent, _, name = key.rpartition("/")
        q = quantile(name)
        if parent and q is not None and all(lane == "" for _, lane in by_line):
            found.setdefault(parent, []).append((q, key))
    return {
        (parent if parent not in lines else f"{parent} (quantiles)"): sorted(quantiles)
        for parent, quantiles in found.items()
        if len(quantiles) >= 2
    }


def figure(
    lines: Lines,
    title: str | None = None,
    unstepped: Set[str] = frozenset(),
    step: str = "step",
    logy: bool = False,
):
    """The figure of `lines` (`read_lines`): a panel per key, placed by `arrange`, titled by
    its key. Each run has one colour in every panel; where there are several, one legend
    above the panels names them (under `title`). A key with one value per device has a line
    per device (a colour each, in a legend of its panel), or, with several runs or more than
    `MAX_DEVICE_LINES` devices, the mean over the devices with their range shaded; a key of
    vectors (lane `ELEMENTS`) the mean of each vector's elements, their range shaded. A
    point with no finite neighbour on its line is marked, as is every point of a short line
    (`MARKED`). Every panel's x axis spans every run's first to last step (the steps of NaN
    values too), with integer ticks where the steps are integers; a dashed line marks the
    first step at which each run's values of a key are NaN or infinite, labelled. A key
    without a finite value says so in its panel. x is `step`, or for the keys in `unstepped`
    the index of the record; a log scale for y with `logy` (a symmetric one for a key with
    values <= 0). Returns the `matplotlib.figure.Figure`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = list(dict.fromkeys(run for by_line in lines.values() for run, _ in by_line))
    colors = _run_colors(runs)
    groups = bands(lines)
    member = {key: band for band, quantiles in groups.items() for _, key in quantiles}
    rows = arrange(list(dict.fromkeys(member.get(key, key) for key in lines)))
    cols = len(rows[0])
    # the steps of every run, for every panel plotted against them
    steps = [
        x for k, by_line in lines.items() if k not in unstepped for xs, _ in by_line.values()
        for x in xs
    ]  # fmt: skip
    span = _span(steps)
    with plt.rc_context({"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8}):
        fig, axes = plt.subplots(
            len(rows),
            cols,
            figsize=(max(3.4 * cols, 6.0), 2.4 * len(rows) + 0.5 + 0.25 * (len(runs) > 1)),
            squeeze=False,
            layout="constrained",
        )
        for r, row in enumerate(rows):
            for c, key in enumerate(row):
                if key is None:
                    axes[r, c].set_visible(False)
                    continue
                # the step under the lowest panel of a column only
                below = r + 1 == len(rows) or rows[r + 1][c] is None
                if key in groups:
                    quantiles = [(q, k, lines[k]) for q, k in groups[key]]
                    flat = any(k in unstepped for _, k in groups[key])
                    panel = _Band(key, quantiles, colors, len(runs) > 1, step, flat)
                else:
                    panel = _Panel(key, lines[key], colors, len(runs) > 1, step, key in unstepped)
                panel.draw(axes[r, c], below, logy, None if key in unstepped else span)
        if len(runs) > 1:  # one legend for every panel, the title above its entries
            handles = [Line2D([], [], color=colors[run], linewidth=2) for run in runs]
            per_row = int(3.4 * cols * 72 / 6.5 / (max(len(run) for run in runs) + 5))
            legend = fig.legend(
                handles,
                runs,
                loc="outside upper center",
                ncols=max(1, min(len(runs), per_row)),
                frameon=False,
                fontsize=9,
                title=title,
                title_fontsize=11,
            )
            legend.set_gid("runs")
        elif title:
            fig.suptitle(title, fontsize=11)
    return fig


class _Panel:
    """One key's panel: `by_line` its lines (`read_lines`)."""

    def __init__(self, key, by_line, colors, several_runs, step, unstepped):
        self.key, self.by_line, self.colors, self.several_runs = key, by_line, colors, several_runs
        self.step = "record" if unstepped else step
        self.xlabel = f"record (no {step})" if unstepped else step

    def draw(self, ax, below: bool, logy: bool, span: tuple[float, float] | None) -> None:
        """Draw the panel into `ax`; x from `span[0]` to `span[1]` (the run's steps), or where
        None, the panel's own records."""
        import numpy as np
        from matplotlib.ticker import MaxNLocator

        ax.set_title(self.key)
        if below:
            ax.set_xlabel(self.xlabel)
        ys = np.array([y for _, ys in self.by_line.values() for y in _values(ys)], dtype=float)
        xs = [x for xs, _ in self.by_line.values() for x in xs]
        finite = np.isfinite(ys)
        if not finite.any():
            nan = int(np.isnan(ys).sum())
            what = (
                f"all {len(ys)} values are NaN"
                if nan == len(ys)
                else f"no finite value:\n{nan} NaN, {len(ys) - nan} infinite"
            )
            what += f"\n({self.xlabel} {min(xs):g} to {max(xs):g})"
            ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="0.3")
            ax.set_xticks([])
            ax.set_yticks([])
            return
        if not finite.all():
            nan, bad = int(np.isnan(ys).sum()), int((~finite).sum())
            what = "NaN" if nan == bad else "not finite"
            ax.set_title(f"{self.key} ({bad} of {len(ys)} {what})")
        by_run: dict[str, list[tuple[str, list[float], list]]] = {}
        for (run, lane), (xs_, ys_) in self.by_line.items():
            by_run.setdefault(run, []).append((lane, xs_, ys_))
        note = self._draw_runs(ax, by_run)
        if note:
            kw = dict(ha="right", va="top", transform=ax.transAxes, fontsize=7, color="0.35")
            ax.text(0.98, 0.96, note, **kw)
        if self.key.rsplit("/", 1)[-1] == "nonfinite":  # a count: 0, 1, ..., not 0.02
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            if np.nanmax(np.abs(ys[finite])) == 0:
                ax.set_ylim(-0.1, 1)
        if logy:
            ax.set_yscale("log" if (ys[finite] > 0).all() else "symlog")
        ax.set_xlim(span or _span(xs))
        if all(float(x).is_integer() for x in xs if math.isfinite(x)):  # steps 0, 1, 2: no 0.5
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        self._first_nonfinite(ax, by_run)
        ax.grid(alpha=0.3)

    def _draw_runs(self, ax, by_run) -> str | None:
        """Draw each run's lines; returns the panel's note (what a shaded range is), if any."""
        notes = {}  # "devices"/"values": the numbers of them drawn as a mean and range
        for run, lanes in by_run.items():
            for lane in [lane for lane in lanes if lane[0] == ELEMENTS]:
                n = self._range(ax, [lane], self.colors[run], run)
                notes.setdefault("values", set()).add(n)
            lanes = [lane for lane in lanes if lane[0] != ELEMENTS]
            if not lanes:
                continue
            if len(lanes) == 1 and not lanes[0][0]:
                self._line(ax, lanes[0][1], lanes[0][2], self.colors[run], run)
            elif not self.several_runs and len(lanes) <= MAX_DEVICE_LINES:
                for i, (lane, xs_, ys_) in enumerate(lanes):
                    self._line(ax, xs_, ys_, f"C{i}", run, label=lane, linewidth=1.0)
                ax.legend(fontsize=7, ncols=2 if len(lanes) > 4 else 1, framealpha=0.7)
            else:
                self._range(ax, lanes, self.colors[run], run)
                notes.setdefault("devices", set()).add(len(lanes))
        if notes:
            said = []
            for what, ns in sorted(notes.items()):
                said.append(f"{min(ns)}" if len(ns) == 1 else f"{min(ns)} to {max(ns)}")
                said[-1] += f" {what}"
            return f"mean of {' / '.join(said)}, min to max shaded"
        return None

    def _first_nonfinite(self, ax, by_run) -> None:
        """A dashed line at the first step of each run's non-finite values (`_first_nonfinite`;
        the least over its devices), in the run's colour where there are several, labelled
        with the step at the foot of the panel."""
        from matplotlib.transforms import blended_transform_factory

        on_x = blended_transform_factory(ax.transData, ax.transAxes)
        for run, lanes in by_run.items():
            found = [f for _, xs, ys in lanes if (f := _first_nonfinite(self.key, xs, ys))]
            if not found:
                continue
            x, what = min(found, key=lambda f: f[0])
            color = self.colors[run] if self.several_runs else "0.2"
            label = f"first {what} at {self.step} {x:g}"
            ax.axvline(x, color=color, linestyle="--", linewidth=1.0, label=f"_{label}", gid=run)
            # along the line, on its left, under the curves (which it must not hide)
            ax.annotate(
                label,
                (x, 0.03),
                xycoords=on_x,
                xytext=(-2, 0),
                textcoords="offset points",
                rotation=90,
                ha="right",
                va="bottom",
                fontsize=7,
                color=color,
                zorder=1.5,
            )

    @staticmethod
    def _line(ax, xs, ys, color, run, label=None, linewidth=1.2) -> None:
        """A line of `run` (its `gid`), its points marked where there are few, and otherwise
        the points without a finite neighbour (which a line alone leaves invisible: the one
        finite value of a run that went NaN)."""
        import numpy as np

        finite = np.isfinite(np.asarray(ys, dtype=float)) & np.isfinite(np.asarray(xs, float))
        alone = finite & ~np.r_[False, finite[:-1]] & ~np.r_[finite[1:], False]
        marker, every = ("o", None) if len(xs) <= MARKED else (None, None)
        if marker is None and alone.any():
            marker, every = "o", [int(i) for i in np.flatnonzero(alone)]
        kw = dict(color=color, label=label, linewidth=linewidth, marker=marker, markevery=every)
        ax.plot(xs, ys, ms=3, gid=run, **kw)

    def _range(self, ax, lanes, color, run) -> int:
        """The mean over the devices (or a vector's elements) at each x, their minimum to
        maximum shaded; returns the most values at one x."""
        import numpy as np

        at: dict[float, list[float]] = {}
        for _, xs, ys in lanes:
            for x, y in zip(xs, ys):
                at.setdefault(x, []).extend(y if isinstance(y, list) else (y,))
        xs = sorted(at)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (an x with NaN only)
            lo, mean, hi = (
                np.array([f(np.array(at[x], dtype=float)) for x in xs])
                for f in (np.nanmin, np.nanmean, np.nanmax)
            )
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0, gid=run)
        self._line(ax, xs, mean, color, run)
        return max(len(v) for v in at.values())


class _Band(_Panel):
    """A panel of quantiles (`bands`): each run's median (p50, or the quantile nearest 0.5) a
    line, the range between its outermost quantiles shaded, and each ring inside it shaded
    again, lighter, over it (p25 to p75 within p10 to p90; p50 to p90 within p50 to p99 where
    the quantiles are 0.5, 0.9, 0.99), so that the middle of the distribution reads darker and
    every quantile bounds a shade."""

    def __init__(self, key, quantiles, colors, several_runs, step, unstepped):
        # each quantile a lane of the run (for the checks of NaN, the x span, the marks)
        by_line = {(run, k): xy for _, k, by_line in quantiles for (run, _), xy in by_line.items()}
        super().__init__(key, by_line, colors, several_runs, step, unstepped)
        self.quantiles = [(q, k) for q, k, _ in quantiles]
        qs = [q for q, _ in self.quantiles]
        n = len(qs)
        self.middle = m = min(range(n), key=lambda i: (abs(qs[i] - 0.5), -qs[i]))
        # the rings, outermost first: (lower, upper) indices, the median where one side ends
        self.rings = [
            (i if i < m else m, n - 1 - i if n - 1 - i > m else m) for i in range(max(m, n - 1 - m))
        ]

    def _draw_runs(self, ax, by_run) -> str | None:
        import numpy as np

        for run, lanes in by_run.items():
            at = {k: dict(zip(xs, ys)) for k, xs, ys in lanes}
            color = self.colors[run]
            for ring, (lo, hi) in enumerate(self.rings):
                lo, hi = self.quantiles[lo][1], self.quantiles[hi][1]
                if lo not in at or hi not in at:
                    continue
                xs = sorted(set(at[lo]) & set(at[hi]))
                lows = np.array([at[lo][x] for x in xs], dtype=float)
                highs = np.array([at[hi][x] for x in xs], dtype=float)
                alpha = 0.2 if ring == 0 else 0.14
                ax.fill_between(xs, lows, highs, color=color, alpha=alpha, linewidth=0, gid=run)
            median = self.quantiles[self.middle][1]
            if median in at:
                xs = sorted(at[median])
                self._line(ax, xs, [at[median][x] for x in xs], color, run)
        names = [k.rsplit("/", 1)[-1] for _, k in self.quantiles]
        rings = ", ".join(f"{names[lo]} to {names[hi]}" for lo, hi in self.rings)
        return f"{names[self.middle]}; {rings} shaded"


def plot(
    lines: Lines,
    output: str,
    title: str | None = None,
    unstepped: Set[str] = frozenset(),
    step: str = "step",
    logy: bool = False,
) -> None:
    """Draw `figure(...)` into `output` (any format matplotlib writes)."""
    import matplotlib.pyplot as plt

    fig = figure(lines, title, unstepped, step, logy)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
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
        lines, skipped, unstepped = read_lines(files, keys, args.step)
    except ValueError as e:  # a file that is not a JsonlLogger's, named by the reader
        print(f"error: {e}", file=sys.stderr)
        return 2
    if skipped:
        names = ", ".join(sorted(skipped))
        print(f"not plotted (values are not numbers): {names}", file=sys.stderr)
    if not lines:
        print(no_match(files, keys, args.step), file=sys.stderr)
        return 2
    try:
        plot(lines, output, args.run_dir, unstepped, args.step, args.logy)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != "matplotlib":
            raise
        print(
            "error: plot needs matplotlib: pip install '.[plot]' from the eqx_logs checkout "
            "(or pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    n = sum(len(c) for c in lines.values())
    print(f"wrote {output}: {len(lines)} keys, {n} curves from {len(files)} file(s)")
    runs = list(dict.fromkeys(run for by_line in lines.values() for run, _ in by_line))
    if len(runs) > 1:
        print("runs: " + ", ".join(runs))
    empty = [key for key, by_line in lines.items() if not _finite(by_line)]
    if empty:
        where = "every key" if len(empty) == len(lines) else ", ".join(empty)
        print(
            f"no finite value (NaN or infinite only; its panel says so): {where}",
            file=sys.stderr,
        )
    return 0


def _finite(by_line: dict[tuple[str, str], tuple[list[float], list]]) -> bool:
    return any(math.isfinite(y) for _, ys in by_line.values() for y in _values(ys))
