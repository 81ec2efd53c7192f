"""What `watch` costs: a spool with `watch=` against the same program without it.

- The neural ODE of `bench_diffrax.py` (Tsit5 + PID, dim 128): `watch="while"` (statistics of
  every leaf of every while loop's carry at each iteration, `reduce="mean"`); the same with
  `where=` keeping the solver's state `y` alone; `watch="tanh"` (the vector field's
  activation, at every evaluation).
- The 4-layer transformer training step of `bench_instrument.py` (adam):
  `watch="dot_general"` (every matmul's output, forward and backward, as statistics), and
  `first_nonfinite="any"` (every operation that can make a NaN or an infinity checked; target
  1.3x).

Each variant is checked first: its number of events is the number of iterations (or calls)
it watches. Measured side by side in one run (variants interleaved, median of per-round
ratios).

Run from the repository root: `python benchmarks/bench_watch.py [--quick]`.
"""

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402
import bench_diffrax  # noqa: E402
import bench_instrument  # noqa: E402

import eqx_logs  # noqa: E402

ANY_TARGET = 1.3  # first_nonfinite="any" on the transformer step
Y = "watch/while[0]/carry/*"  # diffrax's step loop: its carry (the state among it)


def _ode(watch):
    spooled = eqx_logs.spool(bench_diffrax.solve, watch=watch, reduce="mean")
    return jax.jit(spooled)


def _check_ode(k) -> int:
    """The step loop's carry is watched once per step, and a vector field's tanh once per
    evaluation (diffrax's Tsit5: 6 per step, the first same as last)."""
    _, logs = _ode(eqx_logs.Watch("while", where=Y))(k)
    steps = {int(logs.count[key]) for key in logs}
    seen = []

    def hook(t, y):
        jax.debug.callback(lambda: seen.append(1))

    jax.block_until_ready(jax.jit(lambda k: bench_diffrax.solve(k, hook))(k))
    _, tanh = _ode("tanh")(k)
    evaluations = {int(c) for c in tanh.count.values()}
    if len(steps) != 1 or evaluations != {len(seen)}:
        print(f"ERROR: steps {steps}, tanh events {evaluations}, callbacks {len(seen)}")
        return 1
    print(f"{steps.pop()} steps, {len(seen)} vector-field evaluations: counted as watched")
    return 0


def _transformer():
    model = bench_instrument.Transformer(jax.random.key(0))
    opt_state = bench_instrument.OPTIM.init(eqx.filter(model, eqx.is_array))
    x = jax.random.randint(jax.random.key(1), (16, 64), 0, bench_instrument.VOCAB)
    y = jnp.roll(x, -1, axis=1)
    watched = eqx.filter_jit(
        eqx_logs.spool(bench_instrument.step_body, watch="dot_general", reduce="mean")
    )
    checked = eqx.filter_jit(eqx_logs.spool(bench_instrument.step_body, first_nonfinite="any"))
    return model, opt_state, x, y, watched, checked


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    repeats = 7 if parser.parse_args().quick else 15
    print(f"jax {jax.__version__}")
    k = jnp.float32(0.3)
    if _check_ode(k):
        return 1
    plain = jax.jit(bench_diffrax.solve)
    every = _ode("while")
    state = _ode(eqx_logs.Watch("while", where=Y))
    tanh = _ode("tanh")
    model, opt_state, x, y, watched_step, checked_step = _transformer()
    _, logs = watched_step(model, opt_state, x, y)
    print(f"transformer step: {len(logs)} keys of dot_general statistics")
    _, logs = checked_step(model, opt_state, x, y)
    checks = int(logs.count["first_nonfinite/checked"])
    if logs.first_nonfinite is not None:
        print(f"ERROR: a finite step reports {logs.first_nonfinite}")
        return 1
    print(f"transformer step, first_nonfinite='any': {checks} events (runs of checks), all finite")
    times = bench_core.interleaved(
        {
            "plain": lambda: jax.block_until_ready(plain(k)),
            "while": lambda: jax.block_until_ready(every(k)),
            "while, y": lambda: jax.block_until_ready(state(k)),
            "tanh": lambda: jax.block_until_ready(tanh(k)),
            "step": lambda: jax.block_until_ready(
                bench_instrument.plain_step(model, opt_state, x, y)
            ),
            "step, dot_general": lambda: jax.block_until_ready(
                watched_step(model, opt_state, x, y)
            ),
            "step, any": lambda: jax.block_until_ready(checked_step(model, opt_state, x, y)),
        },
        repeats,
    )
    summary = bench_core.Summary()
    for name, base, what in (
        ("while", "plain", "diffrax, watch='while' (every carry leaf)"),
        ("while, y", "plain", "diffrax, watch='while', where= the step loop"),
        ("tanh", "plain", "diffrax, watch='tanh' (every evaluation)"),
        ("step, dot_general", "step", "transformer step, watch='dot_general'"),
        ("step, any", "step", "transformer step, first_nonfinite='any'"),
    ):
        ratio = bench_core.paired_ratio(times[name], times[base])
        median = bench_core.fmt_time(float(np.median(times[name])))
        target = ANY_TARGET if name == "step, any" else None
        ok = None if target is None else ratio <= target
        summary.add(f"{what} ({median})", f"{ratio:.3f}x", f"<= {target}" if target else "-", ok)
    summary.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
