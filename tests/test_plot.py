"""`python -m eqx_logs plot`: the figures it draws of real runs (examples/train.py with
`instrument=all` in a sweep of two learning rates, examples/distributed.py's per-device
values, three runs of one file from `jax.vmap(logger.init)`, NaN-only keys), checked through
matplotlib's objects; and its command line. Each test saves its pictures under its tmp_path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import without_device_count
from jax import lax

import eqx_logs
from eqx_logs.loggers import JsonlLogger, read_jsonl

pytest.importorskip("matplotlib")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.image import imsave  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from eqx_logs._plot import arrange, figure, find_runs, main, read_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TRAIN_KEYS = ["loss", "grad/layer0", "grad/layer1", "grad/layer2"]
STATS = ["mean", "std", "rms", "absmax", "nonfinite"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("HYDRA_FULL_ERROR", None)
    # the suite's XLA flags kept, without a device count: distributed.py adds its own
    env["XLA_FLAGS"] = without_device_count()
    return env


def _sweep(base: Path, script: str, *overrides: str) -> Path:
    """`python examples/<script> --multirun <overrides>` into `base/sweep`."""
    out = base / "sweep"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--multirun", f"hydra.sweep.dir='{out}'"]
        + list(overrides),
        capture_output=True,
        text=True,
        cwd=base,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def instrumented(tmp_path_factory) -> Path:
    """Two runs of examples/train.py with every layer's statistics (34 keys each)."""
    return _sweep(
        tmp_path_factory.mktemp("instrumented"),
        "train.py",
        "train.lr=0.02,0.1",
        "instrument=all",
        "train.steps=200",
        "train.chunk=100",
    )


@pytest.fixture(scope="module")
def devices(tmp_path_factory) -> Path:
    """examples/distributed.py on 4 CPU devices: spooled (`grad_norm`, a record holding a
    value per device) and streamed (`train.stream=true`: a record per device, `"d": i`)."""
    return _sweep(
        tmp_path_factory.mktemp("devices"),
        "distributed.py",
        "train.stream=false,true",
        "train.steps=40",
        "train.chunk=20",
        "logging.interval=2",
    )


def draw(path: Path, picture: Path, *keys: str):
    """The figure of the runs under `path` (as the command draws it), saved as `picture`: laid
    out and rendered once (as `savefig` does), the checks reading that rendering."""
    files = find_runs(str(path))
    lines, _, unstepped = read_lines(files, keys or ("*",))
    fig = figure(lines, str(path), unstepped)
    fig.canvas.draw()
    imsave(picture, fig.canvas.buffer_rgba())
    return fig


def visible(fig) -> list:
    return [ax for ax in fig.axes if ax.get_visible()]


def run_colors(fig) -> dict[str, str]:
    """Each run's colour, from the figure's one legend (which also names every run)."""
    (legend,) = fig.legends
    return {
        t.get_text(): to_hex(h.get_color())
        for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }


def check_colors(fig, runs: list[str]) -> None:
    """Every line and shaded range of a run has the run's colour, in every panel (the lines
    of one run's devices in a panel of one run aside); one legend for the figure, none in
    the panels but those naming devices."""
    colors = run_colors(fig)
    assert list(colors) == runs
    assert len(set(colors.values())) == len(runs)
    for ax in visible(fig):
        drawn = [(a.get_gid(), a) for a in ax.lines + ax.collections]
        assert {gid for gid, _ in drawn} == set(runs), ax.get_title()
        for gid, artist in drawn:
            color = artist.get_color() if artist in ax.lines else artist.get_facecolor()[0]
            assert to_hex(color) == colors[gid], (ax.get_title(), gid)
        assert ax.get_legend() is None, ax.get_title()


def check_title_above(fig, title) -> None:
    """The title (and the runs' legend) lies above every panel of the first row, titles and
    tick labels included."""
    renderer = fig.canvas.get_renderer()
    top = max(ax.get_position().y0 for ax in visible(fig))
    first = [ax for ax in visible(fig) if ax.get_position().y0 == top]
    highest = max(ax.get_tightbbox(renderer).y1 for ax in first)
    assert title.get_window_extent(renderer).y0 > highest
    for legend in fig.legends:
        assert legend.get_window_extent(renderer).y0 > highest
    assert title.get_window_extent(renderer).y1 <= fig.bbox.y1 + 0.5  # inside the image


def test_instrument_all_in_several_runs(instrumented, tmp_path, capsys):
    """`instrument=all` in a sweep of two runs: the loss and training metrics in the first
    row, then a row per layer's output and gradient, a column per statistic, each panel
    named by its key; one colour per run in every panel, one legend; the title clear of the
    first row."""
    assert main(["plot", str(instrumented), "-o", str(tmp_path / "sweep.png")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'sweep.png'}: 34 keys, 68 curves from 2 file(s)" in out, out
    assert "runs: train.lr=0.02, train.lr=0.1" in out, out

    fig = draw(instrumented, tmp_path / "instrumented-sweep.png")
    rows = {}
    for ax in visible(fig):
        rows.setdefault(round(ax.get_position().y0, 4), []).append(ax)
    titles = [[ax.get_title() for ax in row] for _, row in sorted(rows.items(), reverse=True)]
    layers = [f"layers[{i}]{g}" for i in range(3) for g in ("", "/grad")]
    assert titles == [TRAIN_KEYS] + [[f"{w}/{s}" for s in STATS] for w in layers]
    # a statistic keeps its column: every `rms` above every other `rms`
    columns = {ax.get_title().rsplit("/", 1)[-1]: ax.get_position().x0 for ax in visible(fig)}
    assert all(
        ax.get_position().x0 == columns[ax.get_title().rsplit("/", 1)[-1]]
        for ax in visible(fig)
        if "layers" in ax.get_title()
    )
    check_colors(fig, ["train.lr=0.02", "train.lr=0.1"])
    (legend,) = fig.legends
    check_title_above(fig, legend.get_title())
    assert legend.get_title().get_text() == str(instrumented)
    plt.close(fig)

    # one run of them: its title is the figure's, above the first row; no legend
    fig = draw(instrumented / "0", tmp_path / "instrumented-one.png")
    assert not fig.legends and len(visible(fig)) == 34
    check_title_above(fig, fig._suptitle)
    assert [ax.get_title() for ax in visible(fig)][:4] == TRAIN_KEYS
    plt.close(fig)


def test_per_device_values_draw_a_line_per_device(devices, tmp_path, capsys):
    """examples/distributed.py's `grad_norm`, one value per device in each record: a line per
    device, each along the steps (not one line zigzagging through the devices' values at each
    step); the streamed run's records (one per device, `"d": i`) likewise, for `loss` too.
    Both runs together: each run's mean over its devices, its range shaded, in its colour."""
    for run, keys in [("0", {"grad_norm"}), ("1", {"loss", "grad_norm"})]:
        fig = draw(devices / run, tmp_path / f"devices-{run}.png")
        for ax in visible(fig):
            if ax.get_title() not in keys:  # (the spooled run's loss: merged on the device)
                assert len(ax.lines) == 1, ax.get_title()
                continue
            labels = [line.get_label() for line in ax.lines]
            prefix = "device " if run == "0" else "d="
            assert labels == [f"{prefix}{i}" for i in range(4)], (run, labels)
            assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
            for line in ax.lines:
                xs = list(line.get_xdata())
                assert xs == list(range(0, 40, 2)), (run, line.get_label(), xs)
        plt.close(fig)

    # keys of a value per device are keys of numbers, to the command line too
    assert main(["plot", str(devices / "0"), "-k", "grad", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "its keys of numbers:\n  grad_norm, loss\n" in err and "not plotted" not in err, err
    assert main(["plot", str(devices / "0"), "-o", str(tmp_path / "devices-0-cli.png")]) == 0
    assert "wrote" in capsys.readouterr().out

    fig = draw(devices, tmp_path / "devices-both.png")
    check_colors(fig, ["train.stream=False", "train.stream=True"])  # (as Hydra names them)
    by_title = {ax.get_title(): ax for ax in visible(fig)}
    ax = by_title["grad_norm"]
    assert len(ax.lines) == 2 and len(ax.collections) == 2  # a mean and a range per run
    assert all(isinstance(c, PolyCollection) for c in ax.collections)
    assert [t.get_text() for t in ax.texts] == ["mean of 4 devices, min to max shaded"]
    plt.close(fig)


def test_runs_of_one_file_from_vmap(tmp_path):
    """Three runs written into one file by a vmapped logger: a colour each, one legend."""
    path = tmp_path / "vmap" / "logs.jsonl"

    def train(lr):
        def body(w, i):
            loss, g = jax.value_and_grad(lambda w: jnp.mean((w * jnp.arange(4.0) - 1) ** 2))(w)
            eqx_logs.log({"loss": loss, "grad": g}, step=i)
            return w - lr * g, None

        return lax.scan(body, jnp.float32(0), jnp.arange(30))[0]

    with JsonlLogger(path) as logger:
        states = jax.vmap(logger.init)(jnp.arange(3))
        spooled = jax.vmap(lambda s, lr: logger.spool(train, s)(lr))
        jax.jit(spooled)(states, jnp.array([0.01, 0.03, 0.1]))
    fig = draw(path, tmp_path / "vmap-runs.png")
    assert [ax.get_title() for ax in visible(fig)] == ["loss", "grad"]
    check_colors(fig, ["run 0", "run 1", "run 2"])
    check_title_above(fig, fig.legends[0].get_title())
    plt.close(fig)


def test_nan_only_keys_say_so(tmp_path, capsys):
    """A key whose values are all NaN (or NaN and infinite): a message in its panel and on
    stderr, not empty axes; a key with some NaN says how many in its title."""
    nan = tmp_path / "nan" / "logs.jsonl"
    nan.parent.mkdir()
    some = tmp_path / "some" / "logs.jsonl"
    some.parent.mkdir()
    with open(nan, "w") as f:
        for step in range(20):
            for key in ("loss", "grad_norm"):
                f.write(json.dumps({"run": 0, "key": key, "value": "nan", "step": step}) + "\n")
    with open(some, "w") as f:
        for step in range(40):
            rows = [
                ("loss", 1 / (1 + step) if step < 30 else "nan"),
                ("grad_norm", "nan"),
                ("scale", "inf" if step % 2 else "nan"),
            ]
            for key, value in rows:
                f.write(json.dumps({"run": 0, "key": key, "value": value, "step": step}) + "\n")

    assert main(["plot", str(nan.parent)]) == 0
    err = capsys.readouterr().err
    assert "no finite value (NaN or infinite only; its panel says so): every key" in err, err
    assert (nan.parent / "curves.png").exists()
    fig = draw(nan, tmp_path / "all-nan.png")
    for ax in visible(fig):
        assert not ax.lines
        assert [t.get_text() for t in ax.texts] == ["all 20 values are NaN\n(step 0 to 19)"]
    plt.close(fig)

    assert main(["plot", str(some)]) == 0
    err = capsys.readouterr().err
    assert "its panel says so): grad_norm, scale" in err, err
    fig = draw(some, tmp_path / "some-nan.png")
    by_title = {ax.get_title(): ax for ax in visible(fig)}
    assert set(by_title) == {"loss (10 of 40 NaN)", "grad_norm", "scale"}
    loss = by_title["loss (10 of 40 NaN)"]
    assert len(loss.lines) == 2  # the curve, and a dashed line at its first NaN
    assert list(dashed(loss)[0].get_xdata()) == [30, 30]
    scale = [t.get_text() for t in by_title["scale"].texts]
    assert scale == ["no finite value:\n20 NaN, 20 infinite\n(step 0 to 39)"]
    plt.close(fig)


ENVS = 8  # the environments a `jax.vmap` steps


def rl_step(w, i):
    """A training step that goes NaN: `loss` is finite at step 0 only (-inf at 1, NaN after),
    `grad_norm` is finite before step 10 and at step 11 alone, and `returns` (one per
    environment, under `jax.vmap`) holds a NaN from step 25 on, in environment 3
    (`returns/nonfinite` counts them)."""
    loss = (w - 1.0) ** 2 + jnp.log(1.0 - i)
    grad_norm = jnp.where(i < 10, jnp.abs(w) + 1.0, jnp.sqrt((i - 10.5) * (11.5 - i)))

    def env(e):
        return jnp.sin(e + 0.3 * i) * (1.0 + e) + jnp.where(e == 3, jnp.sqrt(24.5 - i), 0.0)

    returns = jax.vmap(env)(jnp.arange(ENVS, dtype=jnp.float32))
    eqx_logs.log({"loss": loss, "grad_norm": grad_norm, "returns": returns})
    eqx_logs.log_stats("returns", returns, stats=("nonfinite",))  # (0 before step 25)
    return w * 0.9


def run_rl(path: Path, steps: int) -> list[dict]:
    """`steps` calls of `rl_step` through `logger.jit(..., step="i")` into `path`; the records
    written."""
    with JsonlLogger(path) as logger:
        step = logger.jit(rl_step, logger.init(), step="i")
        w = jnp.float32(3.0)
        for i in range(steps):
            w = step(w, i)
    return read_jsonl(path)


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """The steps and values (a row per step for a vector) of `key`, by numpy."""
    mine = [r for r in rows if r["key"] == key]
    return np.array([r["step"] for r in mine]), np.array([r["value"] for r in mine], float)


def first_bad(key: str, steps: np.ndarray, values: np.ndarray) -> float:
    """The first step of a NaN or infinity in `values` (a count of them above 0, for the
    key of a count), by numpy."""
    bad = values > 0 if key.endswith("/nonfinite") else ~np.isfinite(values)
    return float(steps[np.argmax(bad.reshape(len(steps), -1).any(axis=1))])


def dashed(ax) -> list:
    """The panel's vertical lines at a first non-finite step."""
    return [line for line in ax.lines if line.get_label().startswith("_first ")]


def test_a_run_that_went_nan(tmp_path, capsys):
    """A run written by `logger.jit` that went NaN (issue 54): the one finite point of `loss`
    and the lone one of `grad_norm` marked (a line alone leaves them invisible), every panel
    spanning the run's steps 0 to 39 (not -0.04 to 0.04 around the one finite point), a
    dashed line at each key's first non-finite step, labelled; the per-environment vector
    `returns` drawn as the mean of its elements with their range shaded (it was skipped), and
    the line also where the count of its non-finite elements is first above 0; integer ticks
    for integer steps, in a run of three steps too."""
    rows = run_rl(tmp_path / "nan" / "logs.jsonl", 40)
    assert main(["plot", str(tmp_path / "nan")]) == 0
    out = capsys.readouterr()
    assert "wrote" in out.out and "4 keys, 4 curves" in out.out and not out.err, out
    assert (tmp_path / "nan" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    fig = draw(tmp_path / "nan", tmp_path / "went-nan.png")
    by_key = {ax.get_title().split(" (")[0]: ax for ax in visible(fig)}
    assert set(by_key) == {"loss", "grad_norm", "returns", "returns/nonfinite"}
    labels = {"loss": "first -inf at step 1", "grad_norm": "first NaN at step 10"}
    labels["returns"] = "first NaN at step 25"
    labels["returns/nonfinite"] = "first non-finite at step 25"
    for key, ax in by_key.items():
        steps, values = series(rows, key)
        lo, hi = ax.get_xlim()
        assert lo <= steps.min() and hi >= steps.max() and hi - lo < 1.2 * np.ptp(steps), key
        # the first non-finite step, by numpy; the one dashed line there, labelled
        (line,) = dashed(ax)
        assert list(line.get_xdata()) == [first_bad(key, steps, values)] * 2, key
        assert [t.get_text() for t in ax.texts if t.get_text().startswith("first")] == [labels[key]]
        assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator), key
        assert ax.xaxis.get_major_locator()._integer, key
        if key == "returns":
            continue
        (curve,) = [c for c in ax.lines if c is not line]
        np.testing.assert_array_equal(curve.get_xdata(), steps)
        # the points without a finite neighbour, by numpy: 0 (loss), 11 (grad_norm), marked
        finite = np.isfinite(values)
        alone = finite & ~np.r_[False, finite[:-1]] & ~np.r_[finite[1:], False]
        assert list(np.flatnonzero(alone)) == {"loss": [0], "grad_norm": [11]}.get(key, [])
        marked = (curve.get_marker(), curve.get_markevery())
        assert marked == (("o", list(np.flatnonzero(alone))) if alone.any() else ("None", None))

    # the vector: its mean, and min to max shaded, at every step (NaN elements left out)
    ax = by_key["returns"]
    steps, values = series(rows, "returns")
    assert values.shape == (40, ENVS)
    assert ax.get_title() == f"returns ({np.isnan(values).sum()} of {values.size} NaN)"
    (mean,) = [c for c in ax.lines if c not in dashed(ax)]
    np.testing.assert_array_equal(mean.get_xdata(), steps)
    np.testing.assert_allclose(mean.get_ydata(), np.nanmean(values, axis=1), rtol=1e-12)
    (shade,) = ax.collections
    assert isinstance(shade, PolyCollection)
    corners = np.concatenate([p.vertices for p in shade.get_paths()])
    for x, row in zip(steps, values):
        at = corners[corners[:, 0] == x, 1]
        assert at.min() == np.nanmin(row) and at.max() == np.nanmax(row), x
    assert [t.get_text() for t in ax.texts][0] == "mean of 8 values, min to max shaded"
    plt.close(fig)

    # three steps: ticks at 0, 1 and 2 (matplotlib's own put them at every 0.25)
    rows = run_rl(tmp_path / "short" / "logs.jsonl", 3)
    fig = draw(tmp_path / "short", tmp_path / "short.png")
    for ax in visible(fig):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks == [0, 1, 2], (ax.get_title(), ticks)
    plt.close(fig)

    # both runs: each one's dashed line in its colour (loss: both at step 1), x over both
    fig = draw(tmp_path, tmp_path / "both.png")
    check_colors(fig, ["nan/logs.jsonl", "short/logs.jsonl"])
    loss = next(ax for ax in visible(fig) if ax.get_title().startswith("loss"))
    assert [line.get_gid() for line in dashed(loss)] == ["nan/logs.jsonl", "short/logs.jsonl"]
    assert loss.get_xlim()[0] <= 0 and loss.get_xlim()[1] >= 39
    plt.close(fig)


@pytest.mark.fast
def test_arrange_puts_the_metrics_first_and_the_statistics_by_layer():
    keys = [
        "layers[10]/rms", "layers[2]/grad/rms", "layers[2]/rms", "acc", "layers[2]/mean",
        "layers[10]/mean", "val/loss", "loss", "layers[2]/absmax", "lr",
    ]  # fmt: skip
    assert arrange(keys) == [
        ["loss", "val/loss", "acc"],
        ["lr", None, None],
        ["layers[2]/mean", "layers[2]/rms", "layers[2]/absmax"],
        [None, "layers[2]/grad/rms", None],
        ["layers[10]/mean", "layers[10]/rms", None],
    ]
    # fewer than three statistics: no table, rows of panels in the same order
    assert arrange(["b", "x/rms", "a/rms", "loss"]) == [["loss", "b"], ["a/rms", "x/rms"]]
    assert arrange(["a", "b", "c", "d", "e"]) == [["a", "b", "c"], ["d", "e", None]]


# --- the command line ----------------------------------------------------------------------


@pytest.mark.fast
def test_plot_key_patterns_take_brackets_literally_too():
    from eqx_logs._plot import key_matches

    assert key_matches("layers[0]/rms", "layers[0]/*")  # brackets as themselves
    assert key_matches("layers[0]/grad/rms", "layers[0]/*")  # `*` crosses `/`
    assert not key_matches("layers[1]/rms", "layers[0]/*")
    assert key_matches("layers[1]/rms", "layers[?]/rms")
    assert key_matches("layers1/rms", "layers[01]/rms")  # and as fnmatch, a character class
    assert key_matches("layers[0]/rms", "layers*")
    assert key_matches("loss", "loss") and not key_matches("loss2", "loss")
    assert not key_matches("layers[0]/rms", "layers[0]")


def test_plot_cli_says_what_is_missing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_logs", "plot", str(tmp_path), "-o", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"no .jsonl files in {str(tmp_path)!r}" in proc.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.fast
def test_plot_cli_lists_the_keys_when_no_key_matches(tmp_path, capsys):
    """`-k los`: the error lists the keys of numbers there (scalars and vectors) and shows how
    to pick (the closest key, a `prefix/*` pattern), not the files; `-k loss` draws, by
    default beside the file."""
    from eqx_logs._plot import main

    log = tmp_path / "logs.jsonl"
    rows = [("loss", 1.5), ("grad/layer0", 0.5), ("grad/layer1", 0.25), ("v", [1.0, 2.0])]
    rows.append(("tree", {"a": 1.0}))  # (not numbers: a pytree)
    log.write_text(
        "".join(json.dumps({"run": 0, "key": k, "value": v, "step": 0}) + "\n" for k, v in rows)
    )
    assert main(["plot", str(tmp_path), "-k", "los", "-k", "x/*"]) == 2
    err = capsys.readouterr().err
    assert f"no key of numbers matches -k los -k 'x/*' in {log}; its keys of numbers:" in err
    assert "\n  grad/layer0, grad/layer1, loss, v\n" in err, err  # not `tree`
    assert "e.g. -k loss, -k 'grad/*'; without -k every key is plotted" in err, err
    assert str(tmp_path) not in err.replace(str(log), ""), err  # the keys, not a file list
    assert not list(tmp_path.glob("*.png"))
    # a pytree key alone: no key of numbers to suggest
    assert main(["plot", str(tmp_path), "-k", "tree"]) == 2
    err = capsys.readouterr().err
    assert "not plotted (values are not numbers): tree" in err, err
    assert "e.g. -k grad/layer0, -k 'grad/*';" in err, err
    # correct patterns draw as before; without -o, into the directory plotted or beside a file
    assert main(["plot", str(tmp_path), "-k", "loss", "-k", "grad/*"]) == 0
    assert main(["plot", str(log), "-k", "loss"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'curves.png'}: 3 keys, 3 curves from 1 file(s)" in out, out
    assert f"wrote {tmp_path / 'logs.png'}: 1 keys, 1 curves from 1 file(s)" in out, out
    assert (tmp_path / "curves.png").read_bytes()[:4] == (tmp_path / "logs.png").read_bytes()[:4]
    # no key of numbers at all
    (tmp_path / "tree.jsonl").write_text(json.dumps({"run": 0, "key": "t", "value": {"a": 1}}))
    assert main(["plot", str(tmp_path / "tree.jsonl"), "-k", "los"]) == 2
    err = capsys.readouterr().err
    assert f"error: no numbers in {tmp_path / 'tree.jsonl'} (its keys: t)" in err, err


@pytest.mark.fast
def test_plot_cli_suggests_the_key_a_swapped_k_misspells(tmp_path, capsys):
    """`-k lsos`: the example is `loss`, one swap away (difflib alone ranks `lost` as high,
    and took it); `-k 'gard/*'`: a key under `grad/`."""
    from eqx_logs._plot import main

    log = tmp_path / "logs.jsonl"
    rows = [("loss", 1.5), ("lost", 0.5), ("grad/layer0", 0.5), ("gate", 1.0)]
    log.write_text(
        "".join(json.dumps({"run": 0, "key": k, "value": v, "step": 0}) + "\n" for k, v in rows)
    )
    assert main(["plot", str(log), "-k", "lsos"]) == 2
    assert "e.g. -k loss, -k 'grad/*';" in capsys.readouterr().err
    assert main(["plot", str(log), "-k", "gard/*"]) == 2
    assert "e.g. -k grad/layer0, -k 'grad/*';" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_plot_cli_version_and_without_matplotlib(tmp_path):
    import eqx_logs

    run = [sys.executable, "-m", "eqx_logs"]
    proc = subprocess.run(run + ["--version"], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0 and proc.stdout.strip() == f"eqx_logs {eqx_logs.__version__}"
    log = tmp_path / "logs.jsonl"
    log.write_text('{"run": 0, "key": "loss", "value": 1.5, "step": 0}\n')
    # matplotlib missing (an import of it fails, as where it is not installed)
    code = (
        "import sys; sys.modules['matplotlib'] = None; from eqx_logs._plot import main; "
        f"sys.exit(main(['plot', {str(log)!r}, '-o', {str(tmp_path / 'x.png')!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "plot needs matplotlib: pip install '.[plot]'" in proc.stderr, proc.stderr
