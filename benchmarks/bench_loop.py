"""The per-step training loop: one compiled step per Python iteration, writing to a logger.

An Equinox MLP trained with optax's adam, `STEPS` steps of a Python loop, the loss, the
gradient norm and the learning-rate scale logged with `step=i` and `interval=100`, written
to a JSONL file. Each form runs the same loop; the ratio is its wall time over the loop
without logging (`eqx.filter_jit(step)`, the loss ignored), measured side by side
(interleaved, median of the per-round ratios, with their quartiles: on a shared machine
the spread between rounds is as telling as the median), for a small MLP (dispatch-bound) and a wide
one (compute-bound). Target for the recommended form, `logger.jit`: <= 1.05.

`eqx.filter_jit` waits for the device at every call, and `logger.jit` does not (it returns
once the step is dispatched, as `jax.jit` does). So each ratio is also given over a second
loop without logging, `plain, jax.jit`: the step by `jax.jit` over the model's and the
optimiser state's arrays, split from the rest once, by hand.

Forms:

- `habit`: the step returns the loss; every 100th step `float()`s it and writes a line;
- `habit, every metric`: the step returns all three metrics (the gradient norm computed at
  every step, as a step that returns its metrics computes it); every 100th step writes them:
  what logging these values by hand costs, against which `logger.jit` is best compared;
- `habit, jax.jit` and `habit, jax.jit, every metric`: the same, by `jax.jit` (as `plain,
  jax.jit`);
- `logger.jit`: `logger.jit(step, state, interval=100)` (the recommended form);
- `jit + write`: `eqx.filter_jit(eqx_logs.spool(step, interval=100))`, then
  `logger.write(logs)` every step;
- `filter_jit(logger.spool)`, `filter_jit(logger.tap)`: the logger's wrappers inside the
  user's jit (a host callback in every step).

Then the host's side of a call alone: a step with no device work to speak of, by
`logger.jit` and by a `jax.jit` of the arrays split by hand, in microseconds per call.

Every form's file is read back and checked: steps 0, 100, 200, ... with the loss the
`habit` form computed. With `--memory`, the resident memory of a 10,000-step `logger.jit`
loop is sampled every 1,000 steps (it must stay flat).

Run from the repository root: `python benchmarks/bench_loop.py [--quick] [--memory]`.
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

STEPS, INTERVAL, TARGET = 300, 100, 1.05
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
    """The loop without logging; the loops logging by hand (to JSON lines under `path`);
    each logger form as a function running the whole loop; the losses written by hand."""
    model0, opt0, x, y, step, returning = make(width, depth)

    def filter_jitted(fn):
        """(the loop's first state, a call of `eqx.filter_jit(fn)`: state, i -> state, out)"""
        compiled = eqx.filter_jit(fn)

        def call(state, i):
            m, o, out = compiled(*state, x, y, i)
            return (m, o), out

        return (model0, opt0), call

    def jax_jitted(fn):
        """The same, by `jax.jit` over the arrays (the model split once, as by hand): the
        call returns once dispatched, where `eqx.filter_jit` waits for the device."""
        arrays, static = eqx.partition((model0, opt0), eqx.is_array)

        @jax.jit
        def compiled(arrays, x, y, i):
            m, o, out = fn(*eqx.combine(arrays, static), x, y, i)
            return eqx.filter((m, o), eqx.is_array), out

        return arrays, lambda state, i: compiled(state, x, y, i)

    def run_plain(loop):
        def go():
            state, call = loop
            for i in range(STEPS):
                state, _ = call(state, jnp.int32(i))
            jax.block_until_ready(state)

        return go

    habit_losses = {}

    def run_by_hand(name, loop, metrics):
        """The loop logging by hand: every 100th step, `metrics` of the step's third output,
        `float()`ed and written as JSON lines."""

        def go():
            state, call = loop
            with open(os.path.join(path, name), "a") as f:
                for i in range(STEPS):
                    state, out = call(state, jnp.int32(i))
                    if i % INTERVAL == 0:
                        for key, value in metrics(out).items():
                            if key == "loss":
                                habit_losses[i] = float(value)
                            row = {"run": 0, "key": key, "value": float(value), "step": i}
                            f.write(json.dumps(row) + "\n")
            jax.block_until_ready(state)

        return go

    def run_with(make_step, after=None):
        def go(logger, state):
            fn = make_step(logger, state)
            m, o = model0, opt0
            for i in range(STEPS):
                out = fn(m, o, x, y, jnp.int32(i))
                if after is None:
                    m, o, _ = out
                else:
                    (m, o, _), logs = out
                    after(logger, logs, state)
            jax.block_until_ready(m)
            logger.flush()

        return go

    spooled = eqx.filter_jit(eqx_logs.spool(step, interval=INTERVAL))
    forms = {
        "logger.jit": run_with(lambda lg, s: lg.jit(step, s, interval=INTERVAL)),
        "jit + write": run_with(lambda lg, s: spooled, lambda lg, logs, s: lg.write(logs, s)),
        "filter_jit(logger.spool)": run_with(
            lambda lg, s: eqx.filter_jit(lg.spool(step, s, interval=INTERVAL))
        ),
        "filter_jit(logger.tap)": run_with(
            lambda lg, s: eqx.filter_jit(lg.tap(step, s, interval=INTERVAL))
        ),
    }
    loss, every = (lambda loss: {"loss": loss}), (lambda metrics: metrics)
    plains = {
        "plain": run_plain(filter_jitted(step)),
        "plain, jax.jit": run_plain(jax_jitted(step)),
    }
    by_hand = {
        "habit": run_by_hand("habit.jsonl", filter_jitted(step), loss),
        "habit, every metric": run_by_hand("returned.jsonl", filter_jitted(returning), every),
        "habit, jax.jit": run_by_hand("habit_jax.jsonl", jax_jitted(step), loss),
        "habit, jax.jit, every metric": run_by_hand(
            "returned_jax.jsonl", jax_jitted(returning), every
        ),
    }
    return plains, by_hand, forms, habit_losses


def check(path: str, losses: dict[int, float], form: str) -> None:
    rows = [r for r in read_jsonl(path) if r["key"] == "loss"]
    steps = [r["step"] for r in rows]
    want = list(range(0, STEPS, INTERVAL))
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


def measure(name: str, width: int, depth: int, repeats: int) -> dict[str, float]:
    tmp = tempfile.mkdtemp()
    plains, by_hand, forms, losses = loops(width, depth, tmp)
    loggers = {f: JsonlLogger(os.path.join(tmp, f"{i}.jsonl")) for i, f in enumerate(forms)}
    states = {f: loggers[f].init() for f in forms}
    runs = {**plains, **by_hand}
    runs.update({f: (lambda f=f: forms[f](loggers[f], states[f])) for f in forms})
    times = interleaved(runs, repeats)
    for f, logger in loggers.items():
        logger.close()
        check(logger.path, losses, f)
    for file in ("returned.jsonl", "habit_jax.jsonl", "returned_jax.jsonl"):
        check(os.path.join(tmp, file), losses, file)
    base, fast = times["plain"], times["plain, jax.jit"]
    per_step = {k: statistics.median(times[k]) / STEPS * 1e6 for k in plains}
    print(
        f"\n{name} (width {width}, depth {depth}): plain {per_step['plain']:.0f} us/step "
        f"(eqx.filter_jit), {per_step['plain, jax.jit']:.0f} us/step (jax.jit)"
    )
    print(f"  {'':28s} {'/ plain (filter_jit)':>38s}   / plain, jax.jit")
    ratios = {}
    for k in runs:
        if k == "plain":
            continue
        per_round = sorted(t / b for t, b in zip(times[k], base))
        ratios[k] = statistics.median(per_round)
        q1, q3 = (per_round[round(q * (len(per_round) - 1))] for q in (0.25, 0.75))
        to_fast = statistics.median(t / b for t, b in zip(times[k], fast))
        mark = ""
        if k == "logger.jit":
            mark = "  ok" if ratios[k] <= TARGET else f"  MISS (target <= {TARGET})"
        print(
            f"  {k:28s} {ratios[k]:5.2f}x  (rounds' quartiles {q1:.2f}-{q3:.2f})"
            f"   {to_fast:5.2f}x{mark}"
        )
    return ratios


def dispatch(repeats: int, calls: int = 2000) -> None:
    """The host's side of a call: a step that does next to nothing on the device (the small
    MLP's model and adam state in and out, three scalar metrics), so the time per call is
    Python and dispatch. `logger.jit` against a `jax.jit` of the arrays split by hand."""
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

    steps = [jnp.int32(i) for i in range(calls)]

    def run_by_hand():
        state = arrays
        for i in steps:
            state, _ = by_hand(state, x, y, i)
        jax.block_until_ready(state)

    def run_logger(fn):
        def go():
            m, o = model, opt_state
            for i in steps:
                m, o, _ = fn(m, o, x, y, i)
            jax.block_until_ready(m)

        return go

    with JsonlLogger(os.path.join(tempfile.mkdtemp(), "dispatch.jsonl")) as logger:
        runs = {
            "jax.jit, split by hand": run_by_hand,
            "logger.jit, nothing logged": run_logger(
                logger.jit(lambda *a: step(*a, log=False), logger.init())
            ),
            "logger.jit, interval=100": run_logger(
                logger.jit(step, logger.init(), interval=INTERVAL)
            ),
        }
        times = {k: [t / calls * 1e6 for t in ts] for k, ts in interleaved(runs, repeats).items()}
    print(
        f"\nper call, a step with no device work (the small MLP's state in and out; {calls} calls)"
    )
    base = statistics.median(times["jax.jit, split by hand"])
    for k, t in times.items():
        print(f"  {k:28s} {statistics.median(t):6.1f} us  (+{statistics.median(t) - base:.1f})")


def memory(width: int, depth: int) -> None:
    tmp = tempfile.mkdtemp()
    model, opt_state, x, y, step, _ = make(width, depth)
    with JsonlLogger(os.path.join(tmp, "mem.jsonl")) as logger:
        fn = logger.jit(step, logger.init(), interval=INTERVAL)
        samples = []
        for i in range(10_000):
            model, opt_state, _ = fn(model, opt_state, x, y, jnp.int32(i))
            if i % 1000 == 999:
                jax.block_until_ready(model)
                samples.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    rows = read_jsonl(os.path.join(tmp, "mem.jsonl"))
    assert [r["step"] for r in rows if r["key"] == "loss"] == list(range(0, 10_000, INTERVAL))
    print("\nmax resident MiB, every 1000 of 10,000 steps:", [round(s) for s in samples])
    print(f"  growth over the last 9,000 steps: {samples[-1] - samples[0]:.1f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"{STEPS} steps, interval={INTERVAL}, JSONL; "
        f"median of {repeats} interleaved rounds"
    )
    for name, (width, depth) in SIZES.items():
        measure(name, width, depth, repeats)
    dispatch(repeats)
    if args.memory:
        memory(*SIZES["small MLP"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
