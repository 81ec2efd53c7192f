"""Quantiles on the accelerator: runtime against Mean, memory flat in the number of events.

1. Runtime: a 10^6-element float32 value logged at every step of an N-step `lax.scan`, with
   `reduce=Quantiles()` (p50/p90/p99 at 1%) against the same scan with `reduce="mean"`,
   interleaved rounds, medians; the unlogged scan for reference. Target: 1.2x of Mean.
2. Memory (`jax.jit(...).lower(...).compile().memory_analysis()`): temp + output bytes of the
   Quantiles program for N=10 and N=1000 steps. Target: equal (the sketch is fixed-size).
3. The update's ways of counting on this backend: a scatter-add of the events' bucket
   positions into the state's counts; into fresh zeros, then added (what Quantiles does);
   `jnp.bincount` of them, added; and the bucket positions alone.

Run: `python benchmarks/bench_quantiles.py [--quick]`. Exits 0 whatever the ratios.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402

import eqx_logs  # noqa: E402
from eqx_logs._reduce._quantiles import _layout  # noqa: E402

RUNTIME_TARGET = 1.2
SIZE = 10**6


def _step(x):
    return x * 0.999 + 1.0


def program(steps: int, reduce=None):
    def f(x):
        def body(x, _):
            x = _step(x)
            if reduce is not None:
                eqx_logs.log("x", x)
            return x, None

        return lax.scan(body, x, None, length=steps)[0]

    if reduce is None:
        return jax.jit(f)
    return jax.jit(eqx_logs.spool(f, reduce=reduce))


def bench_runtime(summary: bench_core.Summary, steps: int, repeats: int) -> None:
    x = jax.random.normal(jax.random.key(0), (SIZE,), jnp.float32) * 100
    quantiles = program(steps, eqx_logs.Quantiles())
    mean = program(steps, "mean")
    bare = program(steps)
    (_, q_logs), (_, m_logs) = quantiles(x), mean(x)
    # equal work: every event was counted; the values agree with numpy's on the last event
    assert int(q_logs.count["x"]) == steps == int(m_logs.count["x"])
    times = bench_core.interleaved(
        {
            "quantiles": lambda: jax.block_until_ready(quantiles(x)),
            "mean": lambda: jax.block_until_ready(mean(x)),
            "unlogged": lambda: jax.block_until_ready(bare(x)),
        },
        repeats,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["quantiles"] / med["mean"]
    paired = bench_core.paired_ratio(times["quantiles"], times["mean"])
    print(f"\nRuntime: a {SIZE:,}-element float32 value logged every step of {steps} steps")
    for name, t in med.items():
        per = bench_core.fmt_time(t / steps)
        print(f"  {name:10s} {bench_core.fmt_time(t)} ({per} a step)")
    extra = (med["quantiles"] - med["mean"]) / steps / SIZE
    print(f"  ratio quantiles / mean {ratio:.3f} (median of paired ratios {paired:.3f})")
    print(f"  the sketch costs {extra * 1e9:.2f} ns an element more than Mean")
    summary.add(
        f"runtime Quantiles / Mean, {steps} steps",
        f"{ratio:.3f}x",
        f"<= {RUNTIME_TARGET}x",
        ratio <= RUNTIME_TARGET,
    )


def bench_memory(summary: bench_core.Summary) -> None:
    x = jnp.zeros((SIZE,), jnp.float32)
    print(f"\nMemory: a {SIZE:,}-element float32 value logged every step, reduce=Quantiles()")
    sizes = {}
    for steps in (10, 1000):
        stats = program(steps, eqx_logs.Quantiles()).lower(x).compile().memory_analysis()
        sizes[steps] = (stats.temp_size_in_bytes, stats.output_size_in_bytes)
        temp, out = sizes[steps]
        print(f"  N={steps:5d}: temp {temp:,} bytes, output {out:,} bytes")
    layout = _layout(0.01, float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))
    print(f"  (the sketch: {layout.size:,} int32 counts, {layout.size * 4 / 2**10:.0f} KiB)")
    flat = sizes[10] == sizes[1000]
    summary.add("memory N=1000 / N=10", "equal" if flat else str(sizes), "equal", flat)


def bench_counting(summary: bench_core.Summary, repeats: int) -> None:
    layout = _layout(0.01, float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))
    x = jax.random.normal(jax.random.key(1), (SIZE,), jnp.float32) * 100
    counts = jnp.zeros((layout.size,), jnp.int32)

    @jax.jit
    def into_state(counts, x):
        return counts.at[layout.positions(x)].add(jnp.int32(1), mode="promise_in_bounds")

    @jax.jit
    def fresh(counts, x):
        zeros = jnp.zeros_like(counts)
        return counts + zeros.at[layout.positions(x)].add(jnp.int32(1), mode="promise_in_bounds")

    @jax.jit
    def bincount(counts, x):
        return counts + jnp.bincount(layout.positions(x), length=layout.size)

    @jax.jit
    def positions(counts, x):
        return counts[:1] + jnp.sum(layout.positions(x))

    np.testing.assert_array_equal(into_state(counts, x), bincount(counts, x))
    np.testing.assert_array_equal(fresh(counts, x), bincount(counts, x))
    times = bench_core.interleaved(
        {
            "into the state": lambda: jax.block_until_ready(into_state(counts, x)),
            "into zeros": lambda: jax.block_until_ready(fresh(counts, x)),
            "bincount": lambda: jax.block_until_ready(bincount(counts, x)),
            "positions only": lambda: jax.block_until_ready(positions(counts, x)),
        },
        repeats,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nCounting {SIZE:,} float32 elements into {layout.size:,} buckets:")
    for name, t in med.items():
        print(f"  {name:15s} {bench_core.fmt_time(t)} ({t / SIZE * 1e9:.2f} ns an element)")
    for name in ("into the state", "bincount"):
        ratio = med[name] / med["into zeros"]
        summary.add(f"scatter-add {name} / into zeros", f"{ratio:.3f}x", "info", None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    start = time.perf_counter()
    summary = bench_core.Summary()
    bench_runtime(summary, 20 if args.quick else 100, 5 if args.quick else 15)
    bench_memory(summary)
    bench_counting(summary, 5 if args.quick else 15)
    summary.print()
    print(f"total time {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
