"""Core overhead benchmarks for eqx_logs.

Measures, side by side in one process (variants interleaved, medians of repeats):

1. A 1000-step `lax.scan` training loop of a small MLP that logs three scalars per step,
   `jax.jit(eqx_logs.spool(f))`, against the same loop hand-written to return the scalars as
   scan outputs. Target: runtime ratio spool / hand-written <= 1.05. The spooled logs are
   checked against the hand-written outputs, so both variants do the same work.
2. A jitted function that calls `eqx_logs.log` but runs outside any spool, against the same
   function without the call: (a) compiled HLO instruction counts and StableHLO text must be
   equal; (b) per-call dispatch time of a tiny function, target ratio <= 1.2.
   For context: dispatch of a function with `jax.debug.callback`, of the same function with
   the log primitive actually bound (an effect in the jaxpr), and of `eqx_logs.spool(f)`
   called without an outer `jax.jit`.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_core.py [--quick]

The script is a report: it exits 0 when a ratio misses its target (and prints FAIL). It exits
1 only when the spooled logs differ from the hand-written outputs, since the timings then
compare different work.
"""

import argparse
import gc
import os
import platform
import re
import statistics
import sys
import time
import timeit
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqx_logs

STEPS = 1000
BATCH = 32
IN_FEATURES = 16
WIDTH = 64
LR0 = 0.05

TRAIN_TARGET = 1.05
DISPATCH_TARGET = 1.2


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------


class Summary:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []
        self.hard_failures: list[str] = []

    def add(self, name: str, value: str, target: str, ok: bool | None) -> None:
        status = "info" if ok is None else ("PASS" if ok else "FAIL")
        self.rows.append((name, value, target, status))
        if ok is False:
            print(f"  *** FAIL: {name}: {value} (target {target})")

    def print(self) -> None:
        headers = ("benchmark", "measured", "target", "result")
        widths = [max(len(r[i]) for r in [headers, *self.rows]) for i in range(4)]
        line = "  ".join("-" * w for w in widths)
        print()
        print("Summary")
        print(line)
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
        print(line)
        for row in self.rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        print(line)
        n_fail = sum(r[3] == "FAIL" for r in self.rows)
        print(f"{n_fail} FAIL" if n_fail else "all targets met")


def interleaved(
    variants: dict[str, Callable[[], object]], repeats: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Time each variant `repeats` times, rotating the order every round; seconds per run."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                fn = variants[name]
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over repeats of the per-round ratio (robust to slow drifts in machine load)."""
    return statistics.median(a / b for a, b in zip(num, den))


def report_end(misses: list[str], errors: list[str], started: float) -> int:
    """Print the verdict of a benchmark report; its exit code: 1 only if `errors` (the
    compared programs disagree, so the timings compare different work)."""
    print()
    if misses:
        print(f"{len(misses)} MISS: " + "; ".join(misses))
    else:
        print("all targets met")
    print(f"total time {time.perf_counter() - started:.1f} s")
    for msg in errors:
        print(f"ERROR: {msg}", file=sys.stderr)
    return 1 if errors else 0


def hlo_instruction_count(compiled_text: str) -> int:
    return sum(" = " in line for line in compiled_text.splitlines())


def normalised_stablehlo(text: str) -> str:
    return re.sub(r"module @\S+", "module @m", text)


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e3:.3f} ms"


# ----------------------------------------------------------------------------------------
# 1. Training loop: spool vs hand-written scan outputs
# ----------------------------------------------------------------------------------------


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (IN_FEATURES, WIDTH)) / jnp.sqrt(IN_FEATURES),
        "b1": jnp.zeros(WIDTH),
        "w2": jax.random.normal(k2, (WIDTH, 1)) / jnp.sqrt(WIDTH),
        "b2": jnp.zeros(1),
    }


def synthetic_data(key: jax.Array):
    x = jax.random.normal(key, (STEPS, BATCH, IN_FEATURES))
    y = jnp.sin(jnp.sum(x, axis=-1, keepdims=True))
    return jnp.arange(STEPS, dtype=jnp.float32), x, y


def mse(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def train_step(params, batch):
    i, x, y = batch
    lr = LR0 * (1.0 - i / STEPS)
    loss, grads = jax.value_and_grad(mse)(params, x, y)
    gn = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params, (loss, gn, lr)


def train_logged(params, data):
    def body(params, batch):
        params, (loss, gn, lr) = train_step(params, batch)
        eqx_logs.log({"loss": loss, "grad_norm": gn, "lr": lr})
        return params, None

    return lax.scan(body, params, data)[0]


def train_handwritten(params, data):
    return lax.scan(train_step, params, data)


def train_plain(params, data):
    def body(params, batch):
        return train_step(params, batch)[0], None

    return lax.scan(body, params, data)[0]


def bench_training(summary: Summary, repeats: int) -> None:
    print(f"\n[1] {STEPS}-step lax.scan MLP training ({IN_FEATURES}->{WIDTH}->1, batch {BATCH}),")
    print("    3 scalars logged per step: jit(spool(f)) vs hand-written scan outputs")
    key = jax.random.PRNGKey(0)
    params = init_params(key)
    data = synthetic_data(jax.random.PRNGKey(1))

    spooled = jax.jit(eqx_logs.spool(train_logged))
    hand = jax.jit(train_handwritten)
    plain = jax.jit(train_plain)
    unspooled = jax.jit(train_logged)  # logs present, but no spool: should equal `plain`

    compile_s = {}
    for name, fn in [("spool", spooled), ("hand-written", hand)]:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, data))
        compile_s[name] = time.perf_counter() - t0
    jax.block_until_ready(plain(params, data))
    jax.block_until_ready(unspooled(params, data))

    # Equal work: the spooled logs must be the hand-written scan outputs.
    p_s, logs = spooled(params, data)
    p_h, (loss, gn, lr) = hand(params, data)
    p_u = unspooled(params, data)
    equal = True
    try:
        for key_, ref in [("loss", loss), ("grad_norm", gn), ("lr", lr)]:
            assert logs[key_].shape == ref.shape, (key_, logs[key_].shape, ref.shape)
            assert np.allclose(logs[key_], ref), key_
            assert int(logs.count[key_]) == STEPS, (key_, int(logs.count[key_]))
        for a, b in zip(jax.tree.leaves(p_s), jax.tree.leaves(p_h)):
            assert np.allclose(a, b), "final parameters differ"
        for a, b in zip(jax.tree.leaves(p_u), jax.tree.leaves(p_h)):
            assert np.allclose(a, b), "final parameters differ (unspooled)"
    except AssertionError as e:
        equal = False
        summary.hard_failures.append(f"spooled logs != hand-written outputs: {e}")
    summary.add("train: spooled logs == hand-written ys", str(equal), "True", equal)

    times = interleaved(
        {
            "spool": lambda: jax.block_until_ready(spooled(params, data)),
            "hand-written": lambda: jax.block_until_ready(hand(params, data)),
            "no logging": lambda: jax.block_until_ready(plain(params, data)),
        },
        repeats,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, t in med.items():
        extra = (
            f"   (first call, trace+compile: {compile_s[name]:.2f} s)" if name in compile_s else ""
        )
        print(f"    {name:<14} median {fmt_time(t)} over {len(times[name])} runs{extra}")
    ratio = med["spool"] / med["hand-written"]
    paired = paired_ratio(times["spool"], times["hand-written"])
    ratio_plain = med["hand-written"] / med["no logging"]
    print(f"    ratio spool / hand-written: {ratio:.3f} (median of paired ratios {paired:.3f})")
    print(
        f"    ratio hand-written / no logging at all: {ratio_plain:.3f} (context: without "
        "outputs, XLA also drops the loss and grad-norm work)"
    )
    summary.add(
        "train: runtime spool / hand-written",
        f"{ratio:.3f}x",
        f"<= {TRAIN_TARGET}x",
        ratio <= TRAIN_TARGET,
    )

    counts = {
        name: hlo_instruction_count(fn.lower(params, data).compile().as_text())
        for name, fn in [
            ("spool", spooled),
            ("hand-written", hand),
            ("no logging", plain),
            ("logs, no spool", unspooled),
        ]
    }
    print("    compiled HLO instructions: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    summary.add(
        "train: HLO instr spool / hand-written",
        f"{counts['spool']} / {counts['hand-written']}",
        "-",
        None,
    )
    same = counts["logs, no spool"] == counts["no logging"]
    summary.add(
        "train: HLO instr unspooled logs / no logs",
        f"{counts['logs, no spool']} / {counts['no logging']}",
        "equal",
        same,
    )


# ----------------------------------------------------------------------------------------
# 2. Unspooled logs: compiled program and dispatch cost
# ----------------------------------------------------------------------------------------


def make_tiny(*, log: bool = False, callback: bool = False) -> Callable:
    # One name for every variant, so the lowered modules are comparable as text.
    def tiny(x):
        if log:
            eqx_logs.log({"x": x})
        if callback:
            jax.debug.callback(lambda v: None, x)
        return x * 2 + 1

    return tiny


def dispatch_loop(fn: Callable, x: jax.Array, n: int) -> Callable[[], None]:
    def run() -> None:
        y = x
        for _ in range(n):
            y = fn(x)
        jax.block_until_ready(y)

    return run


def forced_effect_loop(fn: Callable, x: jax.Array, n: int) -> Callable[[], None] | None:
    """The log primitive bound but never consumed: what every jitted call with a log would cost
    if `log` always bound it. Uses eqx_logs' private switch, so it is optional context."""
    try:
        from eqx_logs import _compat

        switch = _compat.logging_enabled
    except (ImportError, AttributeError):
        return None
    inner = dispatch_loop(fn, x, n)

    def run() -> None:
        with switch(True):
            inner()

    return run


def bench_unspooled(summary: Summary, repeats: int, calls: int) -> None:
    print("\n[2] jit(f) with eqx_logs.log but no spool, vs the same f without the log call")
    x = jnp.float32(1.0)
    xs = jnp.arange(8, dtype=jnp.float32)
    logged = jax.jit(make_tiny(log=True))
    free = jax.jit(make_tiny())

    # (a) compiled program.
    for arg, label in [(x, "f32[]"), (xs, "f32[8]")]:
        n_logged = hlo_instruction_count(logged.lower(arg).compile().as_text())
        n_free = hlo_instruction_count(free.lower(arg).compile().as_text())
        same_text = normalised_stablehlo(logged.lower(arg).as_text()) == normalised_stablehlo(
            free.lower(arg).as_text()
        )
        print(
            f"    x: {label}: compiled HLO instructions logged {n_logged}, log-free {n_free}; "
            f"StableHLO text identical: {same_text}"
        )
        summary.add(
            f"unspooled: HLO instr logged / free ({label})",
            f"{n_logged} / {n_free}",
            "equal",
            n_logged == n_free,
        )
        summary.add(f"unspooled: StableHLO identical ({label})", str(same_text), "True", same_text)

    # (b) dispatch time.
    variants = {
        "logged": dispatch_loop(logged, x, calls),
        "log-free": dispatch_loop(free, x, calls),
    }
    # Context variants are slower; fewer calls keep the run short (times are per call).
    ctx_calls = max(calls // 4, 1)
    ctx_n = {"logged": calls, "log-free": calls}
    callback = jax.jit(make_tiny(callback=True))
    variants["debug.callback"] = dispatch_loop(callback, x, ctx_calls)
    ctx_n["debug.callback"] = ctx_calls
    forced = forced_effect_loop(jax.jit(make_tiny(log=True)), x, ctx_calls)
    if forced is not None:
        variants["log effect bound"] = forced
        ctx_n["log effect bound"] = ctx_calls
    variants["spool(f), no jit"] = dispatch_loop(eqx_logs.spool(make_tiny(log=True)), x, ctx_calls)
    ctx_n["spool(f), no jit"] = ctx_calls

    times = interleaved(variants, repeats)
    per_call = {k: [t / ctx_n[k] for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in per_call.items()}
    descr = {
        "logged": "jit(f), f calls log, no spool",
        "log-free": "jit(f), no log call",
        "debug.callback": "jit(f) with jax.debug.callback (context)",
        "log effect bound": "jit(f), log primitive bound, unconsumed (context)",
        "spool(f), no jit": "eqx_logs.spool(f) without outer jit (context)",
    }
    for name, t in med.items():
        print(
            f"    {descr[name]:<52} {fmt_time(t):>10} per call "
            f"(median of {repeats} x {ctx_n[name]} calls)"
        )
    ratio = med["logged"] / med["log-free"]
    paired = paired_ratio(per_call["logged"], per_call["log-free"])
    print(f"    ratio logged / log-free: {ratio:.3f} (median of paired ratios {paired:.3f})")
    summary.add(
        "unspooled: dispatch logged / log-free",
        f"{ratio:.3f}x",
        f"<= {DISPATCH_TARGET}x",
        ratio <= DISPATCH_TARGET,
    )
    for name in ("debug.callback", "log effect bound", "spool(f), no jit"):
        if name in med:
            summary.add(
                f"context: dispatch {name} / log-free",
                f"{med[name] / med['log-free']:.1f}x ({fmt_time(med[name])})",
                "-",
                None,
            )


# ----------------------------------------------------------------------------------------
# 3. Cheap calls: a jitted spool of a tiny function, and a LogDict's unflattening
# ----------------------------------------------------------------------------------------

SPOOL_CALL_TARGET = 1.3
UNFLATTEN_TARGET_US = 1.0


def bench_cheap_calls(summary: Summary, repeats: int, calls: int) -> None:
    print("\n[3] jax.jit(spool(f)) of a tiny function, vs jax.jit(f); LogDict unflattening")
    x = jnp.arange(8, dtype=jnp.float32)
    free = jax.jit(make_tiny())
    spooled = jax.jit(eqx_logs.spool(make_tiny(log=True)))
    by_hand = jax.jit(lambda x: (make_tiny()(x), {"x": x}))  # the value returned by hand
    # and with its count, as a LogDict holds it (each output is a buffer of its own per call)
    counted = jax.jit(lambda x: (make_tiny()(x), {"x": x[None]}, {"x": jnp.int32(1)}))
    _, logs = spooled(x)
    np.testing.assert_array_equal(logs["x"], x[None])  # the same work
    variants = {
        "jit(f)": dispatch_loop(free, x, calls),
        "jit(spool(f))": dispatch_loop(spooled, x, calls),
        "jit(f) returning the value": dispatch_loop(by_hand, x, calls),
        "jit(f) returning value, count": dispatch_loop(counted, x, calls),
    }
    times = interleaved(variants, repeats)
    per_call = {k: [t / calls for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in per_call.items()}
    for name, t in med.items():
        print(f"    {name:<30} {fmt_time(t):>10} per call")
    ratio = paired_ratio(per_call["jit(spool(f))"], per_call["jit(f)"])
    summary.add(
        f"cheap: jit(spool(f)) / jit(f) ({fmt_time(med['jit(f)'])} f)",
        f"{ratio:.2f}x",
        f"<= {SPOOL_CALL_TARGET}x",
        ratio <= SPOOL_CALL_TARGET,
    )
    hand = paired_ratio(per_call["jit(f) returning the value"], per_call["jit(f)"])
    summary.add("context: jit(f) returning the value by hand / jit(f)", f"{hand:.2f}x", "-", None)
    both = paired_ratio(per_call["jit(f) returning value, count"], per_call["jit(f)"])
    summary.add("context: ... the value and its count by hand / jit(f)", f"{both:.2f}x", "-", None)
    bench_small_solve(summary, repeats, calls)
    leaves, treedef = jax.tree.flatten(logs)
    n = 20000
    unflatten = min(
        timeit.repeat(lambda: treedef.unflatten(leaves), number=n, repeat=max(repeats, 5))
    )
    us = unflatten / n * 1e6
    print(f"    LogDict unflatten ({len(leaves)} leaves): {us:.2f} us")
    summary.add("cheap: LogDict unflatten", f"{us:.2f} us", f"< {UNFLATTEN_TARGET_US} us", us < 1.0)


def bench_small_solve(summary: Summary, repeats: int, calls: int) -> None:
    """A 16-step diffrax solve of a few microseconds, its vector field logging the mean of
    the state (`reduce="mean"`), against the same solve without the log."""
    try:
        import diffrax
    except ImportError:  # a test dependency
        print("    (diffrax is not installed: no small-solve row)")
        return

    def solve(y0, log=True):
        def field(t, y, args):
            if log:
                eqx_logs.log("y", jnp.mean(y))
            return -y

        term, solver = diffrax.ODETerm(field), diffrax.Euler()
        sol = diffrax.diffeqsolve(term, solver, 0.0, 1.0, 1 / 16, y0)
        return sol.ys[-1]

    y0 = jnp.ones(4, jnp.float32)
    plain = jax.jit(lambda y: solve(y, log=False))
    spooled = jax.jit(eqx_logs.spool(solve, reduce="mean"))
    _, logs = spooled(y0)
    assert int(logs.count["y"]) == 16  # every evaluation of the field, once
    times = interleaved(
        {
            "plain": dispatch_loop(plain, y0, calls // 4),
            "spool": dispatch_loop(spooled, y0, calls // 4),
        },
        repeats,
    )
    ratio = paired_ratio(times["spool"], times["plain"])
    per_call = statistics.median(times["plain"]) / (calls // 4)
    print(f"    16-step diffrax solve: plain {fmt_time(per_call)}, spool {ratio:.2f}x")
    summary.add(
        f"cheap: jit(spool(16-step diffrax solve)) / plain ({fmt_time(per_call)})",
        f"{ratio:.2f}x",
        f"<= {SPOOL_CALL_TARGET}x",
        ratio <= SPOOL_CALL_TARGET,
    )


# ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (~20 s)")
    args = parser.parse_args()
    if args.quick:
        train_repeats, dispatch_repeats, calls = 7, 5, 500
    else:
        train_repeats, dispatch_repeats, calls = 61, 25, 2000

    import jaxlib

    devices = jax.devices()
    print("eqx_logs core benchmarks" + (" (--quick)" if args.quick else ""))
    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, eqx_logs {eqx_logs.__version__}, "
        f"python {platform.python_version()}, numpy {np.__version__}"
    )
    print(
        f"backend {jax.default_backend()}: {devices[0].device_kind} x{len(devices)}, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}"
    )
    t_start = time.perf_counter()
    summary = Summary()
    bench_training(summary, train_repeats)
    bench_unspooled(summary, dispatch_repeats, calls)
    bench_cheap_calls(summary, dispatch_repeats, calls)
    summary.print()
    print(f"total time {time.perf_counter() - t_start:.1f} s")
    if summary.hard_failures:
        for msg in summary.hard_failures:
            print(f"ERROR: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
