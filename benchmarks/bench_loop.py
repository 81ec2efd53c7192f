"""The per-step training loop: one compiled step per Python iteration, writing to a logger.

An Equinox MLP trained with optax's adam, `STEPS` steps of a Python loop, the loss, the
gradient norm and the learning-rate scale logged with the step, written to a JSONL file.
Each form runs the same loop; the ratio is its wall time over the loop without logging by
`jax.jit` (the step over the model's and the optimiser state's arrays, split from the rest
once, by hand, the step passed as a Python int), measured side by side (interleaved, median
of the per-round ratios, with their quartiles: on a shared machine the spread between rounds
is as telling as the median), for a small MLP (dispatch-bound) and a wide one
(compute-bound).

Forms (each takes the step in the form it takes best: a Python int where that compiles
nothing new, a `jnp.int32` elsewhere):

- `eqx.filter_jit`: the loop Equinox users write (it waits for the device at every call);
- `jax.jit, every metric returned`: the step returns all three metrics, the loop reads none;
- `by hand, every 100th step` / `by hand, every step`: the same step, and the loop
  `float()`s the metrics at every 100th step / every step and writes them as JSON lines;
- `logger.jit(step="i", interval=100)`: the step as a Python int; the host skips the logs of
  the steps the interval skips (target: within 1.05x of `jax.jit`);
- `logger.jit(interval=100)`: the step as a `jnp.int32`, gated on the device;
- `logger.jit, nolog`: `logger.jit` of the step with every log removed;
- `logger.jit(step="i")`: every step writes its row (target: within 1.1x of `by hand,
  every step`).

Then the host's side of a call alone: a step with no device work to speak of, by
`logger.jit` and by a `jax.jit` of the arrays split by hand, in microseconds per call.

Every form's file is read back and checked against the losses the `by hand, every step`
loop computed: every 100th step, or every step. With `--memory`, the resident memory of a
10,000-step `logger.jit` loop is sampled every 1,000 steps (it must stay flat).

Then Flax NNX (with flax installed): a classifier (batch 256x10, one hidden layer of 64, 10
classes) and the wide MLP, as `nnx.Module`s trained in place by an `nnx.Optimizer` (adam),
`NNX_STEPS` steps, the loss logged with the step, interval `NNX_INTERVAL`. Each form's ratio
is its wall time over the `nnx.jit` loop of the same step (where a log outside a logger does
nothing), interleaved as above, each round from the same initial state:

- `logger.jit(step="i", interval=10)`: the step as a Python int (target: within 1.1x of
  `nnx.jit`);
- `logger.jit(nnx.jit(step), step="i", interval=10)`: the same, the step given in `nnx.jit`;
- `logger.jit(step="i")`: every step writes its row;
- `logger.jit((model, optimizer), ...)`: the objects passed in a tuple (split at every call,
  the form without the per-structure carry).

Run from the repository root: `python benchmarks/bench_loop.py [--quick] [--memory] [--nnx]`
(`--nnx`: the NNX rows alone).
"""

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_logs
from eqx_logs.loggers import JsonlLogger, read_jsonl

STEPS, INTERVAL = 300, 100
SIZES = {"small MLP": (32, 2), "wide MLP": (1024, 3)}  # (width, depth)
BATCH, IN = 64, 32


def make(width: int, depth: int):
    model = eqx.nn.MLP(IN, 1, width, depth, key=jax.random.key(0))
    opt = optax.adam(1e-3)
    x = jax.random.normal(jax.random.key(1), (BATCH, IN))
    y = jax.random.normal(jax.random.key(2), (BATCH, 1))  # noise: the loss stays away from 0

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def train(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = opt.update(grads, opt_state, model)
        model = eqx.apply_updates(model, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "scale": jnp.float32(1.0)}
        return model, opt_state, metrics

    def step(model, opt_state, x, y, i):
        model, opt_state, metrics = train(model, opt_state, x, y)
        eqx_logs.log(metrics, step=i)
        return model, opt_state, metrics["loss"]

    def returning(model, opt_state, x, y, i):  # by hand: every metric returned, every step
        del i
        return train(model, opt_state, x, y)

    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    return model, opt_state, x, y, step, returning


def loops(width: int, depth: int, path: str):
    """The loops without logging, the loops logging by hand (to JSON lines under `path`), and
    each logger form as a function running the whole loop; the losses written by hand."""
    model0, opt0, x, y, step, returning = make(width, depth)

    def jax_jitted(fn):
        """(the loop's first state, a call of `fn` by `jax.jit` over the arrays: state, i ->
        state, out), the model split once, by hand. The call returns once dispatched."""
        arrays, static = eqx.partition((model0, opt0), eqx.is_array)

        @jax.jit
        def compiled(arrays, x, y, i):
            m, o, out = fn(*eqx.combine(arrays, static), x, y, i)
            return eqx.filter((m, o), eqx.is_array), out

        return arrays, lambda state, i: compiled(state, x, y, i)

    def filter_jitted(fn):
        compiled = eqx.filter_jit(fn)

        def call(state, i):  # (a Python int would be compiled in: a new program each step)
            m, o, out = compiled(*state, x, y, jnp.int32(i))
            return (m, o), out

        return (model0, opt0), call

    def run_plain(loop):
        def go():
            state, call = loop
            for i in range(STEPS):
                state, _ = call(state, i)
            jax.block_until_ready(state)

        return go

    losses = {}

    def run_by_hand(name, every):
        """Every metric returned by the step; every `every` steps the loop `float()`s them
        and writes them as JSON lines."""
        first, call = jax_jitted(returning)

        def go():
            state = first
            with open(os.path.join(path, name), "a") as f:
                for i in range(STEPS):
                    state, metrics = call(state, i)
                    if i % every == 0:
                        for key, value in metrics.items():
                            value = float(value)
                            if key == "loss":
                                losses[i] = value
                            row = {"run": 0, "key": key, "value": value, "step": i}
                            f.write(json.dumps(row) + "\n")
            jax.block_until_ready(state)

        return go

    def run_with(make_step, as_int=False):
        """(logger, state) -> the loop, its step made once (as the `jax.jit` loops' are)."""

        def loop(logger, state):
            fn = make_step(logger, state)

            def go():
                m, o = model0, opt0
                for i in range(STEPS):
                    m, o, _ = fn(m, o, x, y, i if as_int else jnp.int32(i))
                jax.block_until_ready(m)
                logger.flush()

            return go

        return loop

    unlogged = eqx_logs.nolog(step)
    plains = {
        "jax.jit": run_plain(jax_jitted(step)),
        "eqx.filter_jit": run_plain(filter_jitted(step)),
        "jax.jit, every metric returned": run_plain(jax_jitted(returning)),
    }
    by_hand = {
        "by hand, every 100th step": run_by_hand("hand100.jsonl", INTERVAL),
        "by hand, every step": run_by_hand("hand1.jsonl", 1),
    }
    forms = {
        'logger.jit(step="i", interval=100)': (
            run_with(lambda lg, s: lg.jit(step, s, interval=INTERVAL, step="i"), as_int=True),
            INTERVAL,
        ),
        "logger.jit(interval=100)": (
            run_with(lambda lg, s: lg.jit(step, s, interval=INTERVAL)),
            INTERVAL,
        ),
        "logger.jit, nolog": (run_with(lambda lg, s: lg.jit(unlogged, s, step="i"), True), None),
        'logger.jit(step="i")': (run_with(lambda lg, s: lg.jit(step, s, step="i"), True), 1),
    }
    return plains, by_hand, forms, losses


def check(path: str, losses: dict[int, float], form: str, every: int) -> None:
    rows = [r for r in read_jsonl(path) if r["key"] == "loss"]
    steps = [r["step"] for r in rows]
    want = list(range(0, STEPS, every))
    assert steps[-len(want) :] == want, (form, steps)
    got = [r["value"] for r in rows[-len(want) :]]
    np.testing.assert_allclose(got, [losses[s] for s in want], rtol=1e-3, atol=1e-6, err_msg=form)


def interleaved(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Each run once to compile and warm up, then `repeats` rounds of each in turn: the
    seconds each took, per round."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return times


def _ratios(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios."""
    per_round = sorted(t / b for t, b in zip(times, base))
    q1, q3 = (per_round[round(q * (len(per_round) - 1))] for q in (0.25, 0.75))
    return statistics.median(per_round), q1, q3


# form -> (the form its target is against, the target)
TARGETS = {
    'logger.jit(step="i", interval=100)': ("jax.jit", 1.05),
    'logger.jit(step="i")': ("by hand, every step", 1.1),
}


def measure(name: str, width: int, depth: int, repeats: int) -> dict[str, float]:
    tmp = tempfile.mkdtemp()
    plains, by_hand, forms, losses = loops(width, depth, tmp)
    loggers = {f: JsonlLogger(os.path.join(tmp, f"{i}.jsonl")) for i, f in enumerate(forms)}
    states = {f: loggers[f].init() for f in forms}
    runs = {**plains, **by_hand}
    runs.update({f: forms[f][0](loggers[f], states[f]) for f in forms})
    times = interleaved(runs, repeats)
    for f, logger in loggers.items():
        logger.close()
        if forms[f][1] is not None:
            check(logger.path, losses, f, forms[f][1])
    check(os.path.join(tmp, "hand100.jsonl"), losses, "by hand, every 100th", INTERVAL)
    base = times["jax.jit"]
    per_step = statistics.median(base) / STEPS * 1e6
    print(f"\n{name} (width {width}, depth {depth}): jax.jit {per_step:.0f} us/step")
    print(f"  {'':36s} / jax.jit (rounds' quartiles)")
    ratios = {}
    for k in runs:
        if k == "jax.jit":
            continue
        ratios[k], q1, q3 = _ratios(times[k], base)
        line = f"  {k:36s} {ratios[k]:5.2f}x ({q1:.2f}-{q3:.2f})"
        if k in TARGETS:
            against, target = TARGETS[k]
            r, q1, q3 = _ratios(times[k], times[against])
            ok = "ok" if r <= target else "MISS"
            line += f"   / {against}: {r:.2f}x ({q1:.2f}-{q3:.2f}), target {target} {ok}"
        print(line)
    return ratios


def dispatch(repeats: int, calls: int = 2000) -> None:
    """The host's side of a call: a step that does next to nothing on the device (the small
    MLP's model and adam state in and out, three scalar metrics), so the time per call is
    Python and dispatch. `logger.jit` against a `jax.jit` of the arrays split by hand, each
    given the step as a Python int (`logger.jit` without `step=`: a `jnp.int32`)."""
    model, opt_state, x, y, _, _ = make(*SIZES["small MLP"])

    def step(model, opt_state, x, y, i, log=True):
        metrics = {"loss": jnp.sum(x), "grad_norm": jnp.sum(y), "scale": jnp.float32(1.0)}
        if log:
            eqx_logs.log(metrics, step=i)
        return model, opt_state, metrics["loss"]

    arrays, static = eqx.partition((model, opt_state), eqx.is_array)

    @jax.jit
    def by_hand(arrays, x, y, i):
        m, o, loss = step(*eqx.combine(arrays, static), x, y, i, log=False)
        return eqx.filter((m, o), eqx.is_array), loss

    def run_by_hand():
        state = arrays
        for i in range(calls):
            state, _ = by_hand(state, x, y, i)
        jax.block_until_ready(state)

    def run_logger(fn, as_int=True):
        def go():
            m, o = model, opt_state
            for i in range(calls):
                m, o, _ = fn(m, o, x, y, i if as_int else jnp.int32(i))
            jax.block_until_ready(m)

        return go

    def unlogged(model, opt_state, x, y, i):
        return step(model, opt_state, x, y, i, log=False)

    with JsonlLogger(os.path.join(tempfile.mkdtemp(), "dispatch.jsonl")) as logger:
        state = logger.init()
        runs = {
            "jax.jit, split by hand": run_by_hand,
            "logger.jit, nothing logged": run_logger(logger.jit(unlogged, state, step="i")),
            'logger.jit(step="i", interval=100)': run_logger(
                logger.jit(step, state, interval=INTERVAL, step="i")
            ),
            "logger.jit(interval=100)": run_logger(
                logger.jit(step, state, interval=INTERVAL), as_int=False
            ),
            'logger.jit(step="i"), every call': run_logger(logger.jit(step, state, step="i")),
        }
        times = {k: [t / calls * 1e6 for t in ts] for k, ts in interleaved(runs, repeats).items()}
    print(
        f"\nper call, a step with no device work (the small MLP's state in and out; {calls} calls)"
    )
    base = statistics.median(times["jax.jit, split by hand"])
    for k, t in times.items():
        print(f"  {k:36s} {statistics.median(t):6.1f} us  (+{statistics.median(t) - base:.1f})")


def memory(width: int, depth: int) -> None:
    tmp = tempfile.mkdtemp()
    model, opt_state, x, y, step, _ = make(width, depth)
    with JsonlLogger(os.path.join(tmp, "mem.jsonl")) as logger:
        fn = logger.jit(step, logger.init(), interval=INTERVAL, step="i")
        samples = []
        for i in range(10_000):
            model, opt_state, _ = fn(model, opt_state, x, y, i)
            if i % 1000 == 999:
                jax.block_until_ready(model)
                samples.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    rows = read_jsonl(os.path.join(tmp, "mem.jsonl"))
    assert [r["step"] for r in rows if r["key"] == "loss"] == list(range(0, 10_000, INTERVAL))
    print("\nmax resident MiB, every 1000 of 10,000 steps:", [round(s) for s in samples])
    print(f"  growth over the last 9,000 steps: {samples[-1] - samples[0]:.1f} MiB")


NNX_STEPS, NNX_INTERVAL = 200, 10
# (batch, inputs, width, depth, outputs; classes: a cross-entropy on integer labels)
NNX_SIZES = {"NNX classifier": (256, 10, 64, 1, 10), "NNX wide MLP": (BATCH, IN, 1024, 3, 1)}


def nnx_loops(batch: int, inputs: int, width: int, depth: int, outputs: int):
    """The NNX model, its optimizer and data; the step (logging its loss with the step), the
    same step taking the objects in a tuple, and the initial state to start each round from."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            sizes = [inputs] + [width] * depth + [outputs]
            self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (batch, inputs))
    if outputs > 1:
        y = jax.random.randint(jax.random.key(2), (batch,), 0, outputs)
        loss_of = optax.softmax_cross_entropy_with_integer_labels
    else:
        y = jax.random.normal(jax.random.key(2), (batch, 1))
        loss_of = lambda out, y: (out - y) ** 2  # noqa: E731

    def step(model, optimizer, x, y, i):
        def loss_fn(model):
            return jnp.mean(loss_of(model(x), y))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        eqx_logs.log({"loss": loss}, step=i)
        return loss

    def tupled(objects, x, y, i):
        return step(*objects, x, y, i)

    first = nnx.to_pure_dict(nnx.state((model, optimizer)))  # (the arrays, not the Variables)
    return nnx, model, optimizer, x, y, step, tupled, first


def measure_nnx(name: str, sizes: tuple, repeats: int) -> dict[str, float]:
    nnx, model, optimizer, x, y, step, tupled, first = nnx_loops(*sizes)

    def reset():
        nnx.update((model, optimizer), first)

    def loop(fn, tuple_form=False):
        def go():
            reset()
            for i in range(NNX_STEPS):
                if tuple_form:
                    fn((model, optimizer), x, y, i)
                else:
                    fn(model, optimizer, x, y, i)
            jax.block_until_ready(nnx.state(model))

        return go

    plain = nnx.jit(step)
    reset()  # the losses of the loop, every step, for the files' check
    losses = [float(plain(model, optimizer, x, y, jnp.int32(i))) for i in range(NNX_STEPS)]
    tmp = tempfile.mkdtemp()
    forms = {
        f'logger.jit(step="i", interval={NNX_INTERVAL})': (
            lambda lg: lg.jit(step, lg.init(), interval=NNX_INTERVAL, step="i"),
            NNX_INTERVAL,
            False,
        ),
        f'logger.jit(nnx.jit(step), step="i", interval={NNX_INTERVAL})': (
            lambda lg: lg.jit(nnx.jit(step), lg.init(), interval=NNX_INTERVAL, step="i"),
            NNX_INTERVAL,
            False,
        ),
        'logger.jit(step="i")': (lambda lg: lg.jit(step, lg.init(), step="i"), 1, False),
        f'logger.jit((model, optimizer), step="i", interval={NNX_INTERVAL})': (
            lambda lg: lg.jit(tupled, lg.init(), interval=NNX_INTERVAL, step="i"),
            NNX_INTERVAL,
            True,
        ),
    }
    loggers = {f: JsonlLogger(os.path.join(tmp, f"nnx{i}.jsonl")) for i, f in enumerate(forms)}
    runs = {"nnx.jit": loop(lambda m, o, x, y, i: plain(m, o, x, y, jnp.int32(i)))}
    for f, (make, _, tuple_form) in forms.items():
        runs[f] = loop(make(loggers[f]), tuple_form)
    times = interleaved(runs, repeats)
    for f, logger in loggers.items():
        logger.close()
        every = forms[f][1]
        rows = [r for r in read_jsonl(logger.path) if r["key"] == "loss"]
        want = list(range(0, NNX_STEPS, every))
        assert [r["step"] for r in rows[-len(want) :]] == want, f
        got = [r["value"] for r in rows[-len(want) :]]
        np.testing.assert_allclose(got, [losses[s] for s in want], rtol=1e-4, err_msg=f)
    base = times["nnx.jit"]
    per_step = statistics.median(base) / NNX_STEPS * 1e6
    print(f"\n{name} {sizes}: nnx.jit {per_step:.0f} us/step ({NNX_STEPS} steps)")
    print(f"  {'':58s} / nnx.jit (rounds' quartiles)")
    ratios = {}
    for k in runs:
        if k == "nnx.jit":
            continue
        ratios[k], q1, q3 = _ratios(times[k], base)
        line = f"  {k:58s} {ratios[k]:5.2f}x ({q1:.2f}-{q3:.2f})"
        if k == f'logger.jit(step="i", interval={NNX_INTERVAL})':
            line += f"   target 1.1 {'ok' if ratios[k] <= 1.1 else 'MISS'}"
        print(line)
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--nnx", action="store_true", help="the Flax NNX rows alone")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"{STEPS} steps, interval={INTERVAL}, JSONL; "
        f"median of {repeats} interleaved rounds"
    )
    if not args.nnx:
        for name, (width, depth) in SIZES.items():
            measure(name, width, depth, repeats)
        dispatch(repeats)
        if args.memory:
            memory(*SIZES["small MLP"])
    try:
        import flax.nnx  # noqa: F401
    except ImportError:
        print("\n(flax not installed: no NNX rows)")
        return 0
    for name, sizes in NNX_SIZES.items():
        measure_nnx(name, sizes, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
