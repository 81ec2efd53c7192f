"""Issue 53's user-facing pieces around the per-example statistics: the plot command's quantile
bands (a JSONL run written by a real logger with `eqx_logs.Quantiles`, and scalar sibling keys
`loss/p10`, ... as the scalar-only backends write them), checked through matplotlib's objects
against the file read back with `json`; the `logging.rules` forms that choose `quantiles` and
`topk` from Hydra's command line (real runs of examples/train.py in a subprocess, a good and a
bad option); and examples/mislabelled.py, whose top-k must name the examples whose labels it
flipped."""

import importlib.util
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

import eqx_logs
from eqx_logs.loggers import JsonlLogger

pytest.importorskip("matplotlib")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from eqx_logs._plot import bands, figure, find_runs, main, read_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _records(path: Path) -> list[dict]:
    """The file's lines, parsed with `json` alone (not the package's reader)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "key" in r]


def _draw(path: Path, *keys: str):
    lines, _, unstepped = read_lines(find_runs(str(path)), keys or ("*",))
    fig = figure(lines, str(path), unstepped)
    fig.canvas.draw()
    return fig, lines


def _panel(fig, title: str):
    (ax,) = [ax for ax in fig.axes if ax.get_visible() and ax.get_title() == title]
    return ax


def _filled(collection: PolyCollection) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(xs, lower, upper)` of a `fill_between`'s polygon: its vertices along the lower edge,
    then back along the upper one (matplotlib's order)."""
    (path,) = collection.get_paths()
    v = path.vertices
    xs = np.unique(v[:, 0])
    lower = np.array([v[v[:, 0] == x, 1].min() for x in xs])
    upper = np.array([v[v[:, 0] == x, 1].max() for x in xs])
    return xs, lower, upper


def check_band(fig, key: str, table: dict[str, dict[int, float]], color=None) -> None:
    """The panel `key` draws the median of `table` (`{"p50": {step: value}}`) as its one line,
    the outermost quantiles' range as its first filled polygon and each ring inside as one
    more, in one colour; no panel per quantile."""
    names = sorted(table, key=lambda n: float(n[1:]))
    ax = _panel(fig, key)
    titles = [a.get_title() for a in fig.axes if a.get_visible()]
    assert not [t for t in titles if t.startswith(f"{key}/p")], titles
    (line,) = ax.lines
    qs = [float(n[1:]) / 100 for n in names]
    median = names[int(np.argmin([abs(q - 0.5) for q in qs]))]
    steps = sorted(table[median])
    np.testing.assert_array_equal(line.get_xdata(), steps)
    np.testing.assert_allclose(line.get_ydata(), [table[median][s] for s in steps], rtol=1e-6)
    fills = [c for c in ax.collections if isinstance(c, PolyCollection)]
    m = names.index(median)
    n = len(names)
    rings = [
        (names[i if i < m else m], names[n - 1 - i if n - 1 - i > m else m])
        for i in range(max(m, n - 1 - m))
    ]
    assert len(fills) == len(rings), (len(fills), rings)
    for fill, (lo, hi) in zip(fills, rings):
        xs, lower, upper = _filled(fill)
        np.testing.assert_array_equal(xs, steps)
        np.testing.assert_allclose(lower, [table[lo][s] for s in steps], rtol=1e-6)
        np.testing.assert_allclose(upper, [table[hi][s] for s in steps], rtol=1e-6)
        if color is not None:
            assert to_hex(fill.get_facecolor()[0][:3]) == to_hex(line.get_color())
    # the outermost range lighter than the rings laid over it, which read darker together
    alphas = [f.get_alpha() for f in fills]
    assert alphas[0] >= max(alphas[1:], default=0.0)
    rings_text = ", ".join(f"{lo} to {hi}" for lo, hi in rings)
    assert [t.get_text() for t in ax.texts] == [f"{median}; {rings_text} shaded"]


# --- the plot command's bands ---------------------------------------------------------------


def test_scalar_quantile_keys_draw_one_band(tmp_path, capsys):
    """Sibling keys `loss/p10` .. `loss/p90` (as a backend of scalars writes a quantile
    reduction), logged by `logger.jit`: one panel `loss`, p50 its line, p10 to p90 filled and
    p25 to p75 over it; `acc` beside it as before; `-k loss` picks the band."""
    path = tmp_path / "q.jsonl"
    offsets = {"p10": -0.3, "p25": -0.1, "p50": 0.0, "p75": 0.15, "p90": 0.4}

    def step(i):
        t = i.astype(jnp.float32)
        median = 1.0 / (1.0 + t)
        eqx_logs.log({f"loss/{n}": median + d * (1.0 + t) for n, d in offsets.items()}, step=i)
        eqx_logs.log("acc", t, step=i)

    with JsonlLogger(path) as logger:
        jitted = logger.jit(step, logger.init(), step="i")
        for i in range(20):
            jitted(i)
    table: dict[str, dict[int, float]] = {}
    for r in _records(path):
        if r["key"].startswith("loss/"):
            table.setdefault(r["key"].split("/")[1], {})[r["step"]] = r["value"]
    assert sorted(table) == sorted(offsets) and all(len(v) == 20 for v in table.values())

    fig, lines = _draw(path)
    assert bands(lines) == {"loss": sorted((float(n[1:]) / 100, f"loss/{n}") for n in offsets)}
    check_band(fig, "loss", table, color=True)
    assert [a.get_title() for a in fig.axes if a.get_visible()] == ["loss", "acc"]
    plt.close(fig)
    fig, _ = _draw(path, "loss/*")
    assert [a.get_title() for a in fig.axes if a.get_visible()] == ["loss"]
    plt.close(fig)
    assert main(["plot", str(path), "-o", str(tmp_path / "q.png")]) == 0
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_quantiles_run_draws_a_band(tmp_path, capsys):
    """A JSONL run of `eqx_logs.Quantiles` (each record's value a dict `{"p10": ..}`, which the
    command read as `not numbers` before): the band of its quantiles, the line equal to the
    file's p50; `-k loss` draws it, a dict without quantiles is still skipped."""
    path = tmp_path / "run.jsonl"
    quantiles = eqx_logs.Quantiles(q=(0.1, 0.5, 0.9))

    def step(x, i):
        losses = x * (1.0 + i.astype(jnp.float32))
        eqx_logs.log("loss", losses, reduce=quantiles, step=i)
        eqx_logs.log("tree", {"a": jnp.sum(losses)}, reduce=eqx_logs.Fanout(a="mean"), step=i)

    x = jax.random.uniform(jax.random.key(0), (64,))
    with JsonlLogger(path) as logger:
        jitted = logger.jit(step, logger.init(), step="i")
        for i in range(12):
            jitted(x, i)
    table: dict[str, dict[int, float]] = {}
    for r in _records(path):
        if r["key"] == "loss":
            assert sorted(r["value"]) == ["p10", "p50", "p90"], r
            for name, v in r["value"].items():
                table.setdefault(name, {})[r["step"]] = v
    # the sketch's quantiles, within its relative error of numpy's (the values are positive)
    for i in range(12):
        want = np.quantile(np.asarray(x) * (1.0 + i), [0.1, 0.5, 0.9], method="lower")
        got = [table[n][i] for n in ("p10", "p50", "p90")]
        np.testing.assert_allclose(got, want, rtol=0.05)
    fig, lines = _draw(path, "loss")
    assert sorted(lines) == ["loss/p10", "loss/p50", "loss/p90"]
    check_band(fig, "loss", table)
    plt.close(fig)
    assert main(["plot", str(path), "-o", str(tmp_path / "run.png")]) == 0
    captured = capsys.readouterr()
    assert "not plotted" not in captured.err or "loss" not in captured.err, captured.err


# --- Hydra: rules that choose the new reductions ---------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("HYDRA_FULL_ERROR", None)  # the message a user sees, not a traceback
    env["XLA_FLAGS"] = without_device_count()
    return env


def _train(base: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    """`python examples/train.py` (200 steps, two chunks, every step kept) into
    `base/name/run`."""
    out = base / name / "run"
    out.parent.mkdir(parents=True)
    return subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train.py"),
            "train.steps=200",
            "train.chunk=100",
            "logging.interval=1",
            f"hydra.run.dir='{out}'",
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=base / name,
        env=_env(),
        timeout=300,
    )


def test_hydra_rules_choose_quantiles_and_topk(tmp_path):
    """`'+logging.rules={loss: quantiles, grad/layer0: {_target_: eqx_logs.TopK, k: 4}}'`
    on the command line: each chunk's loss as the quantiles of its 100 steps' losses (p50,
    p90, p99, the defaults), and the 4 largest gradient norms of layer 0 with the events
    they came from, against the chunk's stacked values from a run without the rule."""
    rules = "{loss: quantiles, grad/layer0: {_target_: eqx_logs.TopK, k: 4}}"
    proc = _train(tmp_path, "rules", f"+logging.rules={rules}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = _train(tmp_path, "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    got = _records(tmp_path / "rules" / "run" / "logs.jsonl")
    stacked = _records(tmp_path / "plain" / "run" / "logs.jsonl")

    def per_chunk(key):
        values = [r["value"] for r in stacked if r["key"] == key]
        return [np.asarray(values[c * 100 : (c + 1) * 100], np.float64) for c in range(2)]

    losses = [r["value"] for r in got if r["key"] == "loss"]
    assert len(losses) == 2, got[:4]
    for value, want in zip(losses, per_chunk("loss")):
        assert sorted(value) == ["p50", "p90", "p99"]
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            ref = np.quantile(want, q, method="lower")
            np.testing.assert_allclose(value[name], ref, rtol=0.03)
    tops = [r["value"] for r in got if r["key"] == "grad/layer0"]
    assert len(tops) == 2
    for top, want in zip(tops, per_chunk("grad/layer0")):
        order = np.argsort(-want, kind="stable")[:4]
        np.testing.assert_allclose(top["value"], want[order], rtol=1e-6)
        assert top["event"] == order.tolist()
    assert "grad/layer1" in {r["key"] for r in got}  # the other keys as the preset says


@pytest.mark.parametrize(
    "rule, says",
    [
        ("{loss: {_target_: eqx_logs.Quantiles, q: [0.5, 1.5]}}", "1.5"),
        ("{loss: {_target_: eqx_logs.Quantiles, relative_error: 2.0}}", "relative_error"),
        ("{grad/layer0: {_target_: eqx_logs.TopK, k: 0}}", "k must be"),
    ],
    ids=["q", "relative_error", "k"],
)
def test_hydra_bad_option_names_the_rule(tmp_path, rule, says):
    """A bad option of a rule's reduction stops the run before training, naming the config
    key of the rule (`logging.rules.loss`) and saying what was wrong; no log file."""
    proc = _train(tmp_path, "bad", f"+logging.rules={rule}")
    assert proc.returncode != 0
    key = rule[1:].split(":")[0]
    assert f"logging.rules.{key}" in proc.stderr, proc.stderr[-3000:]
    assert says in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "bad" / "run" / "logs.jsonl").exists()


def test_hydra_misspelt_rule_name_suggests_topk(tmp_path):
    """`{loss: topkk}`: the policy's own error, `logging.rules.loss='topkk': ... did you mean
    'topk'?`, before anything runs."""
    proc = _train(tmp_path, "typo", "+logging.rules={loss: topkk}")
    assert proc.returncode != 0
    assert "logging.rules.loss='topkk'" in proc.stderr, proc.stderr[-3000:]
    assert "did you mean 'topk'?" in proc.stderr, proc.stderr[-3000:]


# --- examples/mislabelled.py -----------------------------------------------------------------


def _example():
    spec = importlib.util.spec_from_file_location("mislabelled", EXAMPLES / "mislabelled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mislabelled_names_the_flipped_examples(tmp_path, capsys):
    """examples/mislabelled.py: the last epoch's top 16 by loss and by gradient norm, read
    back with `json`, name at least 6 of the 8 examples whose labels the dataset flipped
    (ids from `dataset()`, not from the run), each top-k sorted and of the last epoch; the
    final model's own losses, computed here, rank them high too; the loss quantiles and the
    noise scale are there for every epoch."""
    example = _example()
    *_, flipped = example.dataset()
    assert len(set(flipped.tolist())) == example.FLIPPED
    # (optax's Adam mixes a float and its int32 count: standard promotion for the run)
    with jax.numpy_dtype_promotion("standard"):
        model, path, flipped_again = example.main(str(tmp_path), epochs=example.EPOCHS)
    np.testing.assert_array_equal(flipped, flipped_again)
    out = capsys.readouterr().out
    records = _records(Path(path))
    last = {r["key"]: r["value"] for r in records if r["step"] == example.EPOCHS - 1}
    for key in ("loss/example", "grad_norm/example"):
        top = last[key]
        assert len(top["id"]) == example.K
        assert np.all(np.diff(top["value"]) <= 0), top["value"]
        named = set(top["id"]) & set(flipped.tolist())
        assert len(named) >= 6, (key, top["id"], flipped)
        assert set(top["step"]) == {example.EPOCHS - 1}
    # the final model's own losses rank the flipped examples high too (an independent check)
    x, y, *_ = example.dataset()
    losses = np.asarray(
        jax.vmap(example.example_loss, in_axes=(None, 0, 0))(model, jnp.asarray(x), y)
    )
    worst = set(np.argsort(-losses)[: example.K].tolist())
    assert len(worst & set(flipped.tolist())) >= 6
    epochs = {r["step"] for r in records if r["key"] == "loss"}
    assert epochs == set(range(example.EPOCHS))
    assert {r["step"] for r in records if r["key"] == "noise_scale"} == epochs
    assert f"of the {example.FLIPPED} flipped examples named" in out
