"""The examples run and print what they promise: those without Hydra, examples/instrument.py
against a training loop written out in numpy, and examples/train.py's `instrument` group and
`logging.first_nonfinite` (the rest of the Hydra example is tested by test_config.py)."""

import importlib.util
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers import user_env, without_device_count

ROOT = pathlib.Path(__file__).parent.parent


def _run(script: str, jax_cache: dict[str, str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **jax_cache}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_reductions_example(jax_cache):
    out = _run("reductions.py", jax_cache)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    means = [float(v) for v in lines["loss, mean per 100 steps"].strip("[]").split()]
    assert len(means) == 3 and means[0] > means[1] > means[2]  # training reduces the loss
    assert "'max'" in lines["|grad w| over all steps"]
    assert lines["kept keys"] == "['grad/w', 'loss', 'refine/w']"


def test_quickstart_example(jax_cache):
    out = _run("quickstart.py", jax_cache)
    assert "logged keys: ['dpred', 'grad_norm', 'loss']" in out
    assert "500 events" in out


# examples/step_loop.py as `python examples/step_loop.py <dir>` runs it, then, in the same
# process, the same loop without logging: the reference, printed as JSON on the last line.
_STEP_LOOP_REFERENCE = """
import json, runpy, sys
import equinox as eqx, jax, jax.numpy as jnp
path, out = sys.argv[1:]
sys.argv = [path, out]
runpy.run_path(path, run_name="__main__")
example = runpy.run_path(path)
x, y, model, optimizer, opt_state = example["setup"]()
loss = eqx.filter_jit(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))
step = eqx.filter_jit(example["train_step"])  # its log outside any spool: nothing happens
want = {}
for i in range(1000):
    if i % 100 == 0:
        want[i] = float(loss(model))
    model, opt_state = step(model, opt_state, x, y, jnp.int32(i), optimizer=optimizer)
print(json.dumps(want))
"""


def test_step_loop_example_writes_the_losses_of_the_loop_without_logging(tmp_path, jax_cache):
    """examples/step_loop.py (`logger.jit` in a per-step loop): the file holds steps 0, 100,
    ..., 900, with the losses of the same loop run without logging. Both are compiled as a
    user's are (`user_env`), in one process: over 1,000 Adam steps, two programs rounded
    differently (as at `make test`'s -O0, jax 0.12) drift apart by 1% of the loss."""
    from eqx_logs.loggers import read_jsonl

    example = ROOT / "examples" / "step_loop.py"
    out = subprocess.run(
        [sys.executable, "-c", _STEP_LOOP_REFERENCE, str(example), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**user_env(), "PYTHONPATH": str(ROOT), **jax_cache},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    *printed, reference = out.stdout.splitlines()
    assert "10 losses, steps 0..900" in "\n".join(printed)
    want = {int(step): value for step, value in json.loads(reference).items()}
    rows = read_jsonl(tmp_path / "run.jsonl")
    got = {r["step"]: r["value"] for r in rows if r["key"] == "loss"}
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-4)
    assert [r["step"] for r in rows if r["key"] == "grad_norm"] == list(range(0, 1000, 100))


def _distributed(tmp_path, name: str, *overrides: str, processes: int = 1) -> list[str]:
    """Run examples/distributed.py (as `processes` processes joined over 127.0.0.1, each
    writing into `tmp_path/<name><i>`); returns each process's stdout, after checking that
    its output holds neither JAX's search for a TPU nor XLA's warnings about moving sharded
    values to the host callback ("Involuntary full rematerialization"), nor INFO lines (JAX's
    distributed service) or Gloo's `[Gloo] Rank ... is connected` lines: a run prints what
    the example prints, and nothing on stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the suite's XLA flags kept, without a device count: distributed.py adds its own
    env["XLA_FLAGS"] = without_device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"train.processes={processes}", f"train.coordinator=127.0.0.1:{port}", *overrides]
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "distributed.py"), *args]
            + [f"train.process={i}", f"hydra.run.dir={tmp_path / f'{name}{i}'}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            assert "rematerialization" not in err, err[-3000:]
            assert "tpu" not in (out + err).lower(), out + err[-3000:]
            assert "[Gloo]" not in out + err and "INFO" not in out + err, out + err[-3000:]
            assert not err, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_distributed_example_one_process_and_two(tmp_path):
    from eqx_logs.loggers import read_jsonl

    (out,) = _distributed(tmp_path, "one")
    assert "4 devices in 1 process(es)" in out
    one = read_jsonl(tmp_path / "one0" / "logs.jsonl")
    norms = [r for r in one if r["key"] == "grad_norm"]
    # every 10th step (eqx_logs/conf/logging/default), one value per device
    assert [r["step"] for r in norms] == [[s] * 4 for s in range(0, 200, 10)]
    assert all(len(r["value"]) == 4 for r in norms)
    losses = [r for r in one if r["key"] == "loss"]  # merged over the devices, per chunk
    assert [(r["count"], r["step"]) for r in losses] == [(400, 99), (400, 199)]
    assert losses[1]["value"] < losses[0]["value"]

    # the same run as two processes of 2 devices: the same records, written by process 0
    outs = _distributed(tmp_path, "two", processes=2)
    assert "4 devices in 2 process(es)" in outs[0] and "process(es)" not in outs[1]
    # loopback only, said in the run's log file (not on the terminal)
    log = (tmp_path / "two0" / "distributed.log").read_text()
    assert "Starting JAX distributed service on 127.0.0.1" in log, log
    assert outs[0].splitlines()[1:] == [f"written to {tmp_path / 'two0' / 'logs.jsonl'}"], outs
    assert outs[1] == "", outs[1]
    two = read_jsonl(tmp_path / "two0" / "logs.jsonl")
    assert not (tmp_path / "two1" / "logs.jsonl").exists()
    assert [(r["key"], r.get("step")) for r in two] == [(r["key"], r.get("step")) for r in one]
    for a, b in zip(one, two):
        np.testing.assert_allclose(a["value"], b["value"], rtol=1e-5)


# --------------------------------------------------------------------------------------------
# eqx_logs.instrument in the examples, checked against an MLP trained by SGD written out in
# float32 numpy (forward pass, backward pass and update by hand; no JAX, no eqx_logs)
# --------------------------------------------------------------------------------------------


def _load_example(name: str):
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"eqx_logs_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _numpy_sgd(model, x, y, act, dact, lrs):
    """SGD on `model` (an MLP of `Dense` layers `z = h @ W.T + b`, `act` between them, the
    mean squared error of the last layer's column 0 against `y`), one step per learning rate
    in `lrs`. Yields, before each update, `(zs, dzs, loss)`: each layer's output and its
    cotangent (the gradient of the loss with respect to it), and the loss."""
    ws = [np.asarray(layer.weight, np.float32) for layer in model.layers]
    bs = [np.asarray(layer.bias, np.float32) for layer in model.layers]
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    n = len(ws)
    with np.errstate(all="ignore"):  # the instrument example overflows on purpose
        for lr in lrs:
            hs, zs, h = [], [], x
            for i, (w, b) in enumerate(zip(ws, bs)):
                hs.append(h)
                zs.append(h @ w.T + b)
                h = act(zs[-1]) if i < n - 1 else zs[-1]
            err = zs[-1][:, 0] - y
            dzs = [None] * n
            dz = (np.float32(2) * err / np.float32(len(y)))[:, None]
            for i in reversed(range(n)):
                dzs[i] = dz
                if i:
                    dz = (dz @ ws[i]) * dact(zs[i - 1])
            yield zs, dzs, np.mean(err * err)
            lr = np.float32(lr)
            for i in range(n):
                ws[i] = ws[i] - lr * (dzs[i].T @ hs[i])
                bs[i] = bs[i] - lr * dzs[i].sum(0)


def _np_stats(a: np.ndarray) -> dict[str, float]:
    """What `eqx_logs.instrument` logs, by numpy (in float64)."""
    a64 = a.astype(np.float64)
    return {
        "mean": a64.mean(),
        "std": a64.std(),
        "rms": np.sqrt(np.mean(a64 * a64)),
        "absmax": np.abs(a64).max(),
        "min": a64.min(),
        "max": a64.max(),
        "norm": np.sqrt(np.sum(a64 * a64)),
        "nonfinite": int(np.sum(~np.isfinite(a))),
    }


def test_instrument_example_names_the_first_nonfinite_layer(jax_cache):
    ex = _load_example("instrument")
    out = _run("instrument.py", jax_cache)

    # the replay: the events with a NaN or inf, in execution order (each step: every layer's
    # output, every layer's cotangent from the last layer down, then the loss, logged after)
    model, x, y = ex.setup()
    slope = np.float32(0.01)  # jax.nn.leaky_relu's default
    lrs = [ex.PEAK_LR * min(1.0, (i + 1) / ex.WARMUP) for i in range(ex.STEPS)]
    bad, absmax, nonfinite, losses = [], {}, {}, []
    replay = _numpy_sgd(
        model,
        x,
        y,
        act=lambda z: np.where(z >= 0, z, slope * z),
        dact=lambda z: np.where(z >= 0, np.float32(1), slope),
        lrs=lrs,
    )
    for step, (zs, dzs, loss) in enumerate(replay):
        n = len(zs)
        losses.append(float(loss))
        for i in range(n):
            for name, a in ((f"layers[{i}]", zs[i]), (f"layers[{i}]/grad", dzs[i])):
                absmax[name, step] = float(np.max(np.abs(a)))
                nonfinite[name, step] = int(np.sum(~np.isfinite(a)))
        order = [(f"layers[{i}]", False, zs[i]) for i in range(n)]
        order += [(f"layers[{i}]", True, dzs[i]) for i in reversed(range(n))]
        order += [("loss", False, loss)]
        bad += [(step, name, back) for name, back, a in order if not np.all(np.isfinite(a))]
    assert bad, "the replay never overflows"
    step, layer, backward = bad[0]

    # the report names the layer, the step and the pass that the replay finds first
    what = "gradient (backward pass)" if backward else "output (forward pass)"
    assert f"first non-finite: {layer} {what} at step {step}, key '{layer}" in out, out
    m = re.search(
        r"^first non-finite value: event (\d+) of key '([^']+)', loop iteration (\d+); in the "
        r"(\w+) pass, logged at (.+):(\d+) ",
        out,
        re.M,
    )
    assert m, out
    assert int(m[1]) == step and int(m[3]) == step
    assert m[2] == f"{layer}{'/grad' if backward else ''}/absmax"
    assert m[4] == ("backward" if backward else "forward")
    site = pathlib.Path(m[5]).read_text().splitlines()[int(m[6]) - 1]
    assert "layer(x)" in site  # the call of the layer in the model's __call__
    # what the docstring says happens, so that it stays true
    doc = " ".join(ex.__doc__.split())
    assert "layers[1] overflows first, in the backward pass of step 28" in doc
    assert (step, layer, backward) == (28, "layers[1]", True)
    name = f"{layer}{'/grad' if backward else ''}"
    size = len(x) * ex.SIZES[int(layer[len("layers[") : -1]) + 1]
    assert f"\n{nonfinite[name, step]} of its {size} values are inf or NaN\n" in out, out
    m = re.search(r"^loss: (\S+) at step 0, (\S+) at step (\d+), (\S+) at step (\d+)$", out, re.M)
    assert m and (int(m[3]), int(m[5])) == (step - 1, step), out
    np.testing.assert_allclose(
        [float(m[1]), float(m[2]), float(m[4])], [losses[0], losses[step - 1], losses[step]], 1e-3
    )

    # the table: absmax of every layer's output, then gradient, over the steps before
    lines = out.splitlines()
    head = next(i for i, s in enumerate(lines) if s.startswith("absmax of each layer"))
    steps = [int(s) for s in re.findall(r"step (\d+)", lines[head + 1])]
    assert steps == list(range(step - ex.SHOW, step + 1))
    rows = {}
    for text in lines[head + 2 :]:
        name, *values = text.replace("<- first non-finite", "").split()
        rows[name] = [float(v) for v in values]
    n = len(ex.SIZES) - 1
    order = [f"layers[{i}]" for i in range(n)] + [f"layers[{i}]/grad" for i in range(n)][::-1]
    assert list(rows) == order
    for name, values in rows.items():
        want = [absmax[name, s] for s in steps]
        # printed with 3 significant digits (inf and nan exactly)
        np.testing.assert_allclose(values, want, rtol=1e-2, err_msg=name)


# examples/patch.py: activation patching with `plant` at instrument's paths, against the
# residual MLP run in float64 numpy with the outputs substituted by hand


def _np_residual(model, x, patch: dict) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The example's `ResidualMLP` on `x` in numpy, the output at each path in `patch`
    replaced by `patch[path](output)`; returns the output and every path's output (after
    the patch)."""

    def linear(layer, h):
        return np.asarray(layer.weight, np.float64) @ h + np.asarray(layer.bias, np.float64)

    seen = {}

    def at(path, h):
        seen[path] = patch[path](h) if path in patch else h
        return seen[path]

    h = at("embed", linear(model.embed, np.asarray(x, np.float64)))
    for i, block in enumerate(model.blocks):
        h = h + at(f"blocks[{i}]", np.tanh(linear(block.linear, h)))
    return at("head", linear(model.head, h)), seen


def test_patch_example_against_numpy(jax_cache):
    ex = _load_example("patch")
    out = _run("patch.py", jax_cache)
    lines = dict(line.rsplit(": ", 1) for line in out.splitlines() if ": " in line)

    model, x_a, x_b, y_a = ex.setup()
    y_a = np.asarray(y_a, np.float64)

    def loss(o):
        return float(np.mean((o - y_a) ** 2))

    out_a, on_a = _np_residual(model, x_a, {})
    out_b, on_b = _np_residual(model, x_b, {})
    want = {
        "loss on A": loss(out_a),
        "loss of B's output against A's target": loss(out_b),
    }
    for path in ex.PATHS:
        patched, _ = _np_residual(model, x_a, {path: lambda h, path=path: on_b[path]})
        want[f"A with {path} patched from B"] = loss(patched)
    half = ex.HALF

    def halfway(h):
        return np.concatenate([on_b["blocks[1]"][:half], h[half:]])

    want["A with half of blocks[1] patched from B"] = loss(
        _np_residual(model, x_a, {"blocks[1]": halfway})[0]
    )
    for name, value in want.items():
        np.testing.assert_allclose(float(lines[name]), value, rtol=1e-4, atol=1e-6, err_msg=name)
    # what the docstring promises: embed and head reproduce B; the blocks move part of the way
    assert want["A with embed patched from B"] == pytest.approx(loss(out_b))
    assert lines["patching embed reproduces B's output"] == "True"
    assert lines["patching head reproduces B's output"] == "True"
    for i in range(3):
        assert want[f"A with blocks[{i}] patched from B"] != pytest.approx(loss(out_b), rel=1e-2)
        assert want[f"A with blocks[{i}] patched from B"] != pytest.approx(loss(out_a), rel=1e-2)
    # the statistics of a patched submodule are of the planted value
    rms = re.fullmatch(r"A (\S+), B (\S+), patched (\S+)", lines["rms of blocks[1]'s output"])
    assert rms, out
    rms_a, rms_b = (np.sqrt(np.mean(h["blocks[1]"] ** 2)) for h in (on_a, on_b))
    got = [float(g) for g in rms.groups()]
    np.testing.assert_allclose(got, [rms_a, rms_b, rms_b], rtol=1e-4)


# examples/train.py with `instrument=...` (the Hydra command line, in a subprocess)

TRAIN_STEPS, TRAIN_CHUNK, INTERVAL = 200, 100, 10  # INTERVAL: logging/default.yaml
STATS = ("mean", "std", "rms", "absmax", "nonfinite")  # instrument/all.yaml
LAYERS = ("layers[0]", "layers[1]", "layers[2]")


def _train(
    tmp_path, jax_cache: dict[str, str], *overrides: str
) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    """examples/train.py, 200 steps in chunks of 100, writing into `tmp_path/run`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **jax_cache}
    env.pop("HYDRA_FULL_ERROR", None)  # the message a user sees, not a traceback
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train.py"),
            f"train.steps={TRAIN_STEPS}",
            f"train.chunk={TRAIN_CHUNK}",
            f"hydra.run.dir='{out}'",
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    return proc, out


def _by_key(path: pathlib.Path) -> dict[str, list[dict]]:
    from eqx_logs.loggers import read_jsonl

    out: dict[str, list[dict]] = {}
    for r in read_jsonl(path):
        out.setdefault(r["key"], []).append(r)
    return out


def _value(v) -> float:
    return float(v)  # JSONL writes NaN and infinities as the strings "nan", "inf", "-inf"


def test_train_example_instrument_all(tmp_path, jax_cache, capsys):
    proc, out = _train(tmp_path, jax_cache, "instrument=all")
    assert proc.returncode == 0, proc.stderr
    assert "instrumented: mean, std, rms, absmax, nonfinite of every submodule, gradients too" in (
        proc.stdout
    )
    records = _by_key(out / "logs.jsonl")
    keys = {f"{layer}{g}/{s}" for layer in LAYERS for g in ("", "/grad") for s in STATS}
    assert keys <= set(records), sorted(keys - set(records))
    assert set(records) - keys == {"loss", "grad/layer0", "grad/layer1", "grad/layer2"}

    # every 10th step: 0, 10, ..., 190 (the step's scope gives them the step)
    steps = list(range(0, TRAIN_STEPS, INTERVAL))
    values = {}
    for key in keys:
        assert len(records[key]) == len(steps), key
        assert [r["step"] for r in records[key]] == steps, key
        values[key] = np.array([_value(r["value"]) for r in records[key]])
        assert np.all(np.isfinite(values[key])), key
    for layer in LAYERS:
        for p in (layer, f"{layer}/grad"):
            mean, std, rms = values[f"{p}/mean"], values[f"{p}/std"], values[f"{p}/rms"]
            assert np.all(values[f"{p}/nonfinite"] == 0)
            assert np.all(rms >= np.abs(mean) * (1 - 1e-6)), p
            assert np.all(values[f"{p}/absmax"] >= rms * (1 - 1e-6)), p
            np.testing.assert_allclose(std, np.sqrt(np.maximum(rms**2 - mean**2, 0)), rtol=1e-3)

    # against the example's model trained by SGD in numpy: every statistic at every kept step
    train = _load_example("train")
    import equinox as eqx
    import jax

    kdata, kmodel = jax.random.split(jax.random.key(0))  # examples/conf/config.yaml: train.seed=0
    # each made by one jitted call (the same values, bit for bit, as op by op)
    x, y = jax.jit(train.dataset, static_argnums=1)(kdata, 64)
    model = eqx.filter_jit(train.MLP)(32, kmodel)
    replay = _numpy_sgd(
        model,
        x,
        y,
        act=np.tanh,
        dact=lambda z: np.float32(1) - np.tanh(z) ** 2,
        lrs=[0.05] * TRAIN_STEPS,
    )
    for step, (zs, dzs, _) in enumerate(replay):
        if step % INTERVAL:
            continue
        for i, layer in enumerate(LAYERS):
            for p, a in ((layer, zs[i]), (f"{layer}/grad", dzs[i])):
                want = _np_stats(a)
                scale = want["absmax"]
                for stat in STATS:
                    got = values[f"{p}/{stat}"][step // INTERVAL]
                    np.testing.assert_allclose(
                        got, want[stat], rtol=1e-4, atol=1e-5 * scale, err_msg=f"{p}/{stat} {step}"
                    )

    # the plot command finds them: brackets in -k match themselves (the command's `main`, in
    # this process: its own process is tests/test_plot.py's and test_config.py's)
    from eqx_logs._plot import main as plot

    image = tmp_path / "layer0.png"
    capsys.readouterr()
    assert plot(["plot", str(out), "-k", "layers[0]/*", "-o", str(image)]) == 0
    assert f"wrote {image}: 10 keys, 10 curves from 1 file(s)" in capsys.readouterr().out
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_example_first_nonfinite(tmp_path, jax_cache):
    """`logging.first_nonfinite=true` with a learning rate that blows up: the report names the
    first non-finite value of the run, which the JSONL file (every event: interval 1) shows."""
    proc, out = _train(
        tmp_path,
        jax_cache,
        "instrument=all",
        "logging.first_nonfinite=true",
        "logging.interval=1",
        "train.lr=20",
    )
    assert proc.returncode == 0, proc.stderr
    m = re.search(
        r"^step (\d+): first non-finite value: event (\d+) of key '([^']+)'(?:, step=(\d+))?, "
        r"loop iteration (\d+); in the (\w+) pass, logged at (.+):(\d+) ",
        proc.stdout,
        re.M,
    )
    assert m, proc.stdout
    # one problem, one report: the NaN carries on through the later chunks, unreported
    assert proc.stderr.count("NonfiniteWarning") == 1, proc.stderr
    assert "examples/train.py" in proc.stderr.split("NonfiniteWarning")[0].splitlines()[-1]
    step, key, backward = int(m[1]), m[3], m[6] == "backward"
    assert int(m[5]) == step % TRAIN_CHUNK
    records = _by_key(out / "logs.jsonl")

    def at(k: str, s: int) -> float:
        rows = records[k]
        if "step" in rows[0]:
            (row,) = [r for r in rows if r["step"] == s]
            return _value(row["value"])
        return _value(rows[s]["value"])  # every event, in order

    assert not np.isfinite(at(key, step)), key
    # the events of a step in execution order: each layer's output statistics, each layer's
    # gradient statistics from the last layer down, then the loss with the gradient norms (one
    # `log` call after `value_and_grad`)
    events = [[f"{layer}/{s}" for s in STATS] for layer in LAYERS]
    events += [[f"{layer}/grad/{s}" for s in STATS] for layer in LAYERS[::-1]]
    events += [["loss", "grad/layer0", "grad/layer1", "grad/layer2"]]
    index = next(i for i, keys in enumerate(events) if key in keys)
    assert backward == ("/grad/" in key)
    for s in range(step):
        for k in sum(events, []):
            assert np.isfinite(at(k, s)), (k, s)
    for k in sum(events[:index], []):
        assert np.isfinite(at(k, step)), (k, step)
    if m[4] is not None:
        assert int(m[4]) == step


def test_train_example_healthy_run_reports_no_nonfinite(tmp_path, jax_cache):
    proc, out = _train(tmp_path, jax_cache, "logging.first_nonfinite=true")
    assert proc.returncode == 0, proc.stderr
    assert "first non-finite value: none, every logged value is finite" in proc.stdout
    assert "instrumented: off" in proc.stdout
    records = _by_key(out / "logs.jsonl")  # written with logger.write, as logger.spool would
    assert set(records) == {"loss", "grad/layer0", "grad/layer1", "grad/layer2"}
    assert [r["step"] for r in records["loss"]] == list(range(0, TRAIN_STEPS, INTERVAL))


BAD_INSTRUMENT = {
    "unknown statistic": ("instrument.stats=[foo]", "instrument.stats=['foo']: unknown statistic"),
    "no statistic": (
        "instrument=all instrument.stats=[]",
        "instrument.stats=[]: must be a non-empty list of statistics from ['mean', ",
    ),
    "where not strings": (
        "instrument=all instrument.where=[1]",
        "instrument.where=[1]: must be null (every submodule), a path pattern or a list of them",
    ),
    # found when the model is instrumented, in train.py's main: Hydra shows its traceback
    "where selects nothing": (
        "instrument=all instrument.where=[nope]",
        "instrument.where=['nope']: eqx_logs.instrument(where=('nope',)) selects no submodule of "
        "MLP; its submodules are ['layers[0]', 'layers[1]', 'layers[2]']",
    ),
}


@pytest.mark.parametrize("overrides, message", BAD_INSTRUMENT.values(), ids=list(BAD_INSTRUMENT))
def test_train_example_bad_instrument_value(overrides, message):
    """In this process: examples/train.py's `main` on the config its command line composes
    (test_config's `train_main`; a bad value on the real command line: test_config's
    `test_bad_override_exits_with_message`). It fails before training."""
    from hydra.errors import InstantiationException
    from test_config import train_main

    with pytest.raises((InstantiationException, ValueError)) as info:
        train_main(*overrides.split())
    assert message in str(info.value), str(info.value)


def test_first_nan_example_names_the_operation_and_step():
    """examples/first_nan.py's report, against the steps replayed by hand (one jitted step at a
    time, the probabilities and gradients threaded out): the first step where a picked
    probability rounds to 0 is the one whose `log` is reported, and no gradient of the steps
    before it has a NaN or an infinity."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    ex = _load_example("first_nan")
    with jax.numpy_dtype_promotion("standard"):  # (optax)
        report, losses, stable = ex.main()
        key = jax.random.key(ex.SEED)
        model = eqx.nn.MLP(8, ex.CLASSES, 64, 2, key=key)
        x, labels = ex.data(jax.random.fold_in(key, 1))
        params, static = eqx.partition(model, eqx.is_array)
        optimizer = optax.sgd(ex.LR)

        @jax.jit
        def step(params, state):
            logits = jax.vmap(eqx.combine(params, static))(x)
            picked = jnp.take_along_axis(jax.nn.softmax(logits), labels[:, None], axis=1)
            loss, grads = jax.value_and_grad(
                lambda p: ex.naive_loss(eqx.combine(p, static), x, labels)
            )(params)
            updates, state = optimizer.update(grads, state, params)
            finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
            return optax.apply_updates(params, updates), state, jnp.min(picked), finite

        state, first = optimizer.init(params), None
        for k in range(ex.STEPS):
            params, state, smallest, finite = step(params, state)
            if float(smallest) == 0.0:
                first = k
                break
            assert bool(finite), f"a gradient of step {k} is not finite before any log(0)"
    assert first is not None and first == int(np.argmax(~np.isfinite(np.asarray(losses))))
    assert report.iterations == (first,)
    assert report.operation.startswith("log at ") and not report.backward
    path, line = re.match(r"(.+):(\d+) ", report.site).groups()
    assert "jnp.log(picked)" in pathlib.Path(path).read_text().splitlines()[int(line) - 1]
    assert np.isfinite(stable[first])
