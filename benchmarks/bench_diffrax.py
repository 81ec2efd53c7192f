"""`jax.jit(eqx_logs.spool(diffeqsolve))` against the plain solve, with logs in the vector field.

diffrax's default adjoint (RecursiveCheckpointAdjoint) is a custom_vjp around Equinox's
checkpointed while loop, itself a custom_vjp: spool rebuilds both with the reduction states
threaded through, so the solve runs once. Measured side by side in one run (variants
interleaved, median of per-round ratios): the forward solve and `jax.grad` of it, spool
(`reduce="mean"` of the state and time at every vector-field evaluation) against the same
solve without logs. Target: ratio <= 1.1. The spooled mean is checked against the mean of
the values collected by a host callback in the plain solve.

Run from the repository root: `python benchmarks/bench_diffrax.py [--quick]`.
"""

import argparse
import sys
from pathlib import Path

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402

import eqx_logs  # noqa: E402

TARGET = 1.1
DIM = 128


W = jax.random.normal(jax.random.key(0), (DIM, DIM)) / DIM**0.5


def solve(k, hook=None):
    def vector_field(t, y, args):  # a small neural ODE
        if hook is not None:
            hook(t, y)
        return jnp.tanh(W @ y) - k * y + jnp.sin(t)

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Tsit5(),
        t0=0.0,
        t1=20.0,
        dt0=0.05,
        y0=jnp.linspace(0.0, 1.0, DIM),
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
        adjoint=diffrax.RecursiveCheckpointAdjoint(),
        max_steps=4096,
    )
    return sol.ys[-1]


def logged(k):
    return solve(k, lambda t, y: eqx_logs.log({"y": jnp.mean(y), "t": t}))


def spooled_loss(k):
    out, logs = eqx_logs.spool(logged, reduce="mean")(k)
    return jnp.sum(out) + 0.0 * logs["y"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    repeats = 7 if parser.parse_args().quick else 21
    print(
        f"jax {jax.__version__}; diffrax {diffrax.__version__}; Tsit5 + PID, neural ODE dim {DIM}"
    )
    k = jnp.float32(0.3)

    # The check: the spooled mean against the values a host callback sees in the same program
    # (a different program may round differently and take another number of steps).
    seen = []

    def both(t, y):
        eqx_logs.log({"y": jnp.mean(y), "t": t})
        jax.debug.callback(seen.append, jnp.mean(y))

    _, logs = jax.jit(eqx_logs.spool(lambda k: solve(k, both), reduce="mean"))(k)
    jax.effects_barrier()
    if int(logs.count["y"]) != len(seen) or not np.isclose(logs["y"], np.mean(seen), rtol=1e-4):
        print(
            f"ERROR: spooled mean {logs['y']} over {logs.count['y']} events, callback mean "
            f"{np.mean(seen)} over {len(seen)}",
            file=sys.stderr,
        )
        return 1
    print(f"{len(seen)} vector-field evaluations per solve, counted and averaged identically")

    plain = jax.jit(solve)
    spooled = jax.jit(lambda k: eqx_logs.spool(logged, reduce="mean")(k))
    plain_grad = jax.jit(jax.grad(lambda k: jnp.sum(solve(k))))
    spooled_grad = jax.jit(jax.grad(spooled_loss))
    times = bench_core.interleaved(
        {
            "plain": lambda: jax.block_until_ready(plain(k)),
            "spool": lambda: jax.block_until_ready(spooled(k)),
            "plain grad": lambda: jax.block_until_ready(plain_grad(k)),
            "spool grad": lambda: jax.block_until_ready(spooled_grad(k)),
        },
        repeats,
    )
    summary = bench_core.Summary()
    for name, base in (("spool", "plain"), ("spool grad", "plain grad")):
        ratio = bench_core.paired_ratio(times[name], times[base])
        median = bench_core.fmt_time(float(np.median(times[name])))
        summary.add(
            f"jit({name}) / jit({base}) ({median})",
            f"{ratio:.3f}x",
            f"<= {TARGET}",
            ratio <= TARGET,
        )
    summary.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
