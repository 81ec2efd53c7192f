"""tap(interval=100) on a 10,000-step scanned training step logging 3 scalars, against the
log-free function; beside it, jax.debug.callback on every step. Then the chunked tap,
`tap(f, buffer=k)`, on a 10,000-step scan logging a scalar every step, against spool (the
same events kept on the device), the tap calling back per event, and `tap(interval=100)` (100
callbacks: the floor of 100 host round trips). Ratios of medians, measured side by side in one
run. Run: `python benchmarks/bench_tap.py [--quick]`."""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import jax
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402

import eqx_logs  # noqa: E402
from eqx_logs.loggers import JsonlLogger  # noqa: E402

STEPS = 10_000
TARGET = 1.5


def data(key):
    x = jax.random.normal(key, (STEPS, bench_core.BATCH, bench_core.IN_FEATURES))
    y = jax.numpy.sin(x.sum(-1, keepdims=True))
    return jax.numpy.arange(STEPS, dtype=jax.numpy.float32) / STEPS * bench_core.STEPS, x, y


def with_debug_callback(params, data):
    def body(params, batch):
        params, metrics = bench_core.train_step(params, batch)
        jax.debug.callback(lambda *m: None, *metrics)
        return params, None

    return lax.scan(body, params, data)[0]


def scalar_scan(xs):
    """A 10,000-step scan logging one scalar every step."""

    def step(c, x):
        c = 0.999 * c + x
        eqx_logs.log("c", c)
        return c, None

    return lax.scan(step, jax.numpy.float32(0), xs)[0]


def chunked_tap(repeats: int, summary: bench_core.Summary) -> None:
    print(f"\nchunked tap: {STEPS}-step scan logging a scalar every step")
    xs = jax.random.normal(jax.random.key(2), (STEPS,))
    events: dict[str, list[int]] = {}  # per variant, the events each host call received

    def counter(name):
        seen = events.setdefault(name, [])
        return lambda logs, steps: seen.append(len(jax.numpy.atleast_1d(logs["c"])))

    def tapped(name, **options):
        return jax.jit(eqx_logs.tap(scalar_scan, callback=counter(name), **options))

    variants = {
        "jit(spool(f))": jax.jit(eqx_logs.spool(scalar_scan)),
        "jit(tap(f)), per event": tapped("jit(tap(f)), per event"),
        **{f"tap(buffer={k})": tapped(f"tap(buffer={k})", buffer=k) for k in (100, 1000, 10000)},
        "tap(interval=100)": tapped("tap(interval=100)", interval=100),
    }

    def runner(fn):
        def run():
            jax.device_get(fn(xs))  # spool's logs, too, reach the host
            jax.effects_barrier()

        return run

    times = bench_core.interleaved({k: runner(f) for k, f in variants.items()}, repeats)
    base = statistics.median(times["jit(spool(f))"])
    want = {"jit(tap(f)), per event": (STEPS, STEPS), "tap(interval=100)": (100, 100)}
    want |= {f"tap(buffer={k})": (STEPS // k, STEPS) for k in (100, 1000, 10000)}
    for name, ts in times.items():
        t = statistics.median(ts)
        line = f"  {name:24s} {t * 1e6:12.1f} us/call  ratio to spool {t / base:8.2f}"
        if name in events:
            calls, kept = want[name]
            per_run = len(events[name]) / (repeats + 2)  # (2 warm-up runs)
            line += f"  host calls/run {per_run:.0f}"
            ok = per_run == calls and sum(events[name]) == kept * (repeats + 2)
            summary.add(f"{name}: host calls, events per run", f"{per_run:.0f}", str(calls), ok)
        print(line)
        if name.startswith("tap(buffer") or name.startswith("jit(tap"):
            summary.add(f"{name} / jit(spool(f))", f"{t / base:.2f}x", "-", None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    repeats = 5 if parser.parse_args().quick else 15
    print(f"jax {jax.__version__}; {STEPS}-step training scan logging 3 scalars")
    params = bench_core.init_params(jax.random.key(0))
    batches = data(jax.random.key(1))
    calls = []
    logger = JsonlLogger(os.path.join(tempfile.mkdtemp(), "bench.jsonl"))
    state = logger.init()
    variants = {
        "log-free": jax.jit(bench_core.train_plain),
        "tap(interval=100)": jax.jit(
            eqx_logs.tap(
                bench_core.train_logged, interval=100, callback=lambda logs, steps: calls.append(1)
            )
        ),
        "JsonlLogger.tap(interval=100)": jax.jit(
            logger.tap(bench_core.train_logged, state, interval=100)
        ),
        "debug.callback every step": jax.jit(with_debug_callback),
    }

    def runner(fn):
        def run():
            jax.block_until_ready(fn(params, batches))
            jax.effects_barrier()
            logger.flush()  # the JSONL lines are written (flushed) before the clock stops

        return run

    times = bench_core.interleaved({k: runner(f) for k, f in variants.items()}, repeats)
    logger.close()
    base = statistics.median(times["log-free"])
    summary = bench_core.Summary()
    for name, ts in times.items():
        ratio = statistics.median(ts) / base
        print(f"  {name:28s} {bench_core.fmt_time(statistics.median(ts))}  ratio {ratio:.2f}")
        if name.startswith("Jsonl"):
            summary.add(
                "JsonlLogger.tap(interval=100), written / log-free", f"{ratio:.2f}x", "-", None
            )
        elif name.startswith("tap"):
            summary.add(
                "tap(interval=100) / log-free", f"{ratio:.2f}x", f"<= {TARGET}x", ratio <= TARGET
            )
        elif name.startswith("debug"):
            summary.add("debug.callback every step / log-free", f"{ratio:.2f}x", "-", None)
    per_call = len(calls) / (repeats + 2)
    summary.add("tap host calls per run", f"{per_call:.0f}", "100", per_call == 100)
    chunked_tap(repeats, summary)
    summary.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
