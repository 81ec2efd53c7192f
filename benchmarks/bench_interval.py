"""An expensive logged statistic with `interval=100`: skipped events must not compute it.

The statistic is the singular values of a 256x256 weight (`jnp.linalg.svd`), logged with
`step=i` beside a cheap training update. With `interval=100`, spool and tap must cost about
what a hand-written version costs that computes the statistic only on every 100th step
(`lax.cond`). Measured side by side in one run (interleaved, median of per-round ratios),
for spool and tap, in a 300-step `lax.scan` and in the per-step loop (300 calls of one jitted
step from Python). Target: ratio <= 1.1. Each spooled run is checked to keep steps 0, 100 and
200 with the hand-written singular values.

Run from the repository root: `python benchmarks/bench_interval.py [--quick]`.
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402

import eqx_logs  # noqa: E402

N, STEPS, INTERVAL, TARGET = 256, 300, 100, 1.1


def update(w):
    return w - 1e-3 * jnp.tanh(w)


def singular_values(w):
    return jnp.linalg.svd(w, compute_uv=False)


def step_logged(w, i):
    eqx_logs.log("sv", singular_values(w), step=i)
    return update(w)


def step_handwritten(w, i):
    sv = lax.cond(i % INTERVAL == 0, singular_values, lambda w: jnp.zeros(N, w.dtype), w)
    return update(w), sv


def scan_logged(w):
    return lax.scan(lambda w, i: (step_logged(w, i), None), w, jnp.arange(STEPS))[0]


def scan_handwritten(w):
    w, svs = lax.scan(step_handwritten, w, jnp.arange(STEPS))
    return w, svs[::INTERVAL]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    repeats = 5 if parser.parse_args().quick else 11
    print(f"jax {jax.__version__}; svd of a {N}x{N} weight, interval={INTERVAL}, {STEPS} steps")
    w0 = jax.random.normal(jax.random.key(0), (N, N)) / N**0.5
    taps = []

    hand_step = jax.jit(step_handwritten)
    spool_step = jax.jit(eqx_logs.spool(step_logged, interval=INTERVAL))
    tap_step = jax.jit(
        eqx_logs.tap(step_logged, interval=INTERVAL, callback=lambda logs, steps: taps.append(1))
    )
    hand_scan = jax.jit(scan_handwritten)
    spool_scan = jax.jit(eqx_logs.spool(scan_logged, interval=INTERVAL))
    tap_scan = jax.jit(
        eqx_logs.tap(scan_logged, interval=INTERVAL, callback=lambda logs, steps: taps.append(1))
    )

    def loop(fn, keep=None):
        w = w0
        for i in range(STEPS):
            out = fn(w, i)
            w = out[0] if isinstance(out, tuple) else out
            if keep is not None and isinstance(out, tuple):
                keep.append(out[1])
        return jax.block_until_ready(w)

    # correctness: the kept steps and their values
    want = jax.device_get(hand_scan(w0)[1])
    kept = []
    loop(spool_step, kept)
    steps = [int(k.step["sv"][0]) for k in kept if int(k.count["sv"])]
    values = np.stack([np.asarray(k["sv"][0]) for k in kept if int(k.count["sv"])])
    _, logs = spool_scan(w0)
    if steps != [0, 100, 200] or not np.allclose(values, want, rtol=1e-4, atol=1e-5):
        print(f"ERROR: per-step loop kept steps {steps}", file=sys.stderr)
        return 1
    if list(np.asarray(logs.step["sv"])) != [0, 100, 200] or not np.allclose(
        logs["sv"], want, rtol=1e-4, atol=1e-5
    ):
        print(f"ERROR: scan kept steps {logs.step['sv']}", file=sys.stderr)
        return 1

    times = bench_core.interleaved(
        {
            "hand loop": lambda: loop(hand_step),
            "spool loop": lambda: loop(spool_step),
            "tap loop": lambda: (loop(tap_step), jax.effects_barrier()),
            "hand scan": lambda: jax.block_until_ready(hand_scan(w0)),
            "spool scan": lambda: jax.block_until_ready(spool_scan(w0)),
            "tap scan": lambda: (jax.block_until_ready(tap_scan(w0)), jax.effects_barrier()),
        },
        repeats,
        warmup=1,
    )
    summary = bench_core.Summary()
    for kind in ("loop", "scan"):
        for name in ("spool", "tap"):
            ratio = bench_core.paired_ratio(times[f"{name} {kind}"], times[f"hand {kind}"])
            median = bench_core.fmt_time(float(np.median(times[f"{name} {kind}"])))
            summary.add(
                f"{name}(interval={INTERVAL}) per-step {kind} / hand-written cond ({median})",
                f"{ratio:.3f}x",
                f"<= {TARGET}",
                ratio <= TARGET,
            )
    summary.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
