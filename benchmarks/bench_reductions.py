"""Reductions on the accelerator: memory and runtime, measured side by side in one run.

1. Memory (from `jax.jit(...).lower(...).compile().memory_analysis()`): a (N, N) float32 array
   logged every step of a T-step scan, with `interval=100` (stack) and with `reduce="mean"`,
   against the hand-written equivalents (a nested scan returning every 100th value; a running
   mean in the carry). Target: temp + output within 1.1x. lox stacks every event and reduces
   on the host afterwards: its temporary is the full (T, N, N) stack, printed for reference.
2. Runtime: `reduce="mean"` over the 1000-step scanned MLP training step of bench_core.py
   logging 3 scalars, against a hand-written running mean in the carry. Target: 1.05x.

Run: `python benchmarks/bench_reductions.py [--quick]`. Exits 0 whatever the ratios.
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

MEMORY_TARGET = 1.1
RUNTIME_TARGET = 1.05
INTERVAL = 100


def _step(x):
    return x * 0.999 + 1.0


def spooled_program(steps: int, **spool_kwargs):
    def f(x):
        def body(x, _):
            x = _step(x)
            eqx_logs.log("x", x)
            return x, None

        return lax.scan(body, x, None, length=steps)[0]

    return jax.jit(eqx_logs.spool(f, **spool_kwargs))


def handwritten_every_100th(steps: int):
    def f(x):
        def inner(x, j):
            x = _step(x)
            return x, None

        def outer(x, _):
            y = _step(x)  # the first step of each block is the kept event
            x, _ = lax.scan(inner, y, jnp.arange(INTERVAL - 1))
            return x, y

        return lax.scan(outer, x, None, length=steps // INTERVAL)

    return jax.jit(f)


def handwritten_mean(steps: int):
    def f(x):
        def body(carry, i):
            x, mean = carry
            x = _step(x)
            mean = mean + (x - mean) / (i + 1)
            return (x, mean), None

        return lax.scan(body, (x, jnp.zeros_like(x)), jnp.arange(steps, dtype=jnp.float32))[0]

    return jax.jit(f)


def memory(fn, x) -> tuple[int, int]:
    stats = fn.lower(x).compile().memory_analysis()
    return stats.temp_size_in_bytes, stats.output_size_in_bytes


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def bench_memory(summary: bench_core.Summary, n: int, steps: int, check: bool) -> None:
    x = jnp.zeros((n, n), jnp.float32)
    print(f"\nMemory: ({n}, {n}) float32 logged every step of a {steps}-step scan")
    cases = [
        ("stack, interval=100", spooled_program(steps, interval=INTERVAL), handwritten_every_100th),
        ("mean", spooled_program(steps, reduce="mean"), handwritten_mean),
    ]
    for name, ours, reference in cases:
        reference = reference(steps)
        t0, o0 = memory(ours, x)
        t1, o1 = memory(reference, x)
        ratio = (t0 + o0) / max(t1 + o1, 1)
        print(f"  {name:22s} eqx_logs: temp {mib(t0)}, output {mib(o0)}")
        print(f"  {'':22s} hand-written: temp {mib(t1)}, output {mib(o1)}  ratio {ratio:.3f}")
        summary.add(
            f"memory {n}x{n}x{steps}, {name}",
            f"{ratio:.3f}x",
            f"<= {MEMORY_TARGET}x",
            ratio <= MEMORY_TARGET,
        )
        if check:  # equal work: the same values come out
            (_, logs), ref = ours(x), reference(x)
            np.testing.assert_allclose(np.asarray(logs["x"]), np.asarray(ref[1]), rtol=1e-4)
    lox_temp = steps * n * n * 4
    print(f"  for reference, stacking every event first (lox): a {mib(lox_temp)} temporary")


def train_handwritten_mean(params, data):
    def body(carry, batch):
        params, mean, i = carry
        params, metrics = bench_core.train_step(params, batch)
        mean = jax.tree.map(lambda m, v: m + (v - m) / (i + 1), mean, metrics)
        return (params, mean, i + 1), None

    zeros = (jnp.float32(0), jnp.float32(0), jnp.float32(0))
    return lax.scan(body, (params, zeros, jnp.float32(0)), data)[0]


def bench_runtime(summary: bench_core.Summary, repeats: int) -> None:
    params = bench_core.init_params(jax.random.key(0))
    data = bench_core.synthetic_data(jax.random.key(1))
    ours = jax.jit(eqx_logs.spool(bench_core.train_logged, reduce="mean"))
    reference = jax.jit(train_handwritten_mean)
    (_, logs), (_, mean, _) = ours(params, data), reference(params, data)
    np.testing.assert_allclose(
        [logs["loss"], logs["grad_norm"], logs["lr"]], np.asarray(mean), rtol=1e-4
    )
    times = bench_core.interleaved(
        {
            "spool mean": lambda: jax.block_until_ready(ours(params, data)),
            "hand-written mean": lambda: jax.block_until_ready(reference(params, data)),
        },
        repeats,
    )
    a, b = statistics.median(times["spool mean"]), statistics.median(times["hand-written mean"])
    ratio = a / b
    print(f"\nRuntime, {bench_core.STEPS}-step training scan, 3 scalars, reduce='mean':")
    print(f"  spool {bench_core.fmt_time(a)}, hand-written {bench_core.fmt_time(b)}")
    paired = bench_core.paired_ratio(*times.values())
    print(f"  ratio {ratio:.3f} (median of paired ratios {paired:.3f})")
    summary.add(
        "runtime reduce='mean' / hand-written",
        f"{ratio:.3f}x",
        f"<= {RUNTIME_TARGET}x",
        ratio <= RUNTIME_TARGET,
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    start = time.perf_counter()
    summary = bench_core.Summary()
    bench_memory(summary, 100, 1000, check=True)  # small: also run and compare values
    if not args.quick:
        bench_memory(summary, 1000, 10_000, check=False)  # the size: compile only
    bench_runtime(summary, 7 if args.quick else 41)
    summary.print()
    print(f"total time {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
