"""Compile cost of `jax.jit(eqx_logs.spool(f))` against the same program written by hand.

The hand-written program returns the logged values as extra outputs, threaded by hand: stacked
with `jnp.stack` or as `lax.scan` outputs for the default reduction (stack), a running mean
for `reduce="mean"`, aux outputs of `jax.grad(..., has_aux=True)` under differentiation. Each
case is checked once (spooled logs == hand-written outputs, `np.allclose`), so both compile
programs that do the same work.

For every case, spool and hand-written are measured side by side, alternating which goes first
in each round, on function objects made afresh for every measurement (after
`jax.clear_caches()`), so nothing is cached between measurements:

- jaxpr equations (`jax.make_jaxpr`, counted recursively through sub-jaxprs: scan bodies, cond
  branches, custom rules; a `jit` equation counts as its body only, so the jit that spool
  wraps its interpreter in is not an equation of its own);
- trace (`jax.jit(f).trace(*args)`), lower (`traced.lower()`) and XLA compile
  (`lowered.compile()`) times, and the first call, their sum;
- the StableHLO text length (`lowered.as_text()`) and the compiled HLO instruction count.

Cases:

1. straight-line code with 100 / 300 / 1000 log sites, `x = sin(cumsum(x))` between them (one
   key; one key with `reduce="mean"`; three keys per site, 100 / 300 sites only);
2. a 4 / 16 / 48-layer MLP as a Python loop, 5 statistics per layer under keys of their own;
3. the same layers in `lax.scan` (weights stacked), the 5 statistics under fixed keys;
4. nested scans of depth 1 / 2 / 4, a log in the innermost body;
5. `jax.grad(..., has_aux=True)` of the Python-loop model of (2), spool inside the grad;
6. a 48-layer MLP training loop: `lax.scan` over steps of an SGD step, `jax.grad` of a
   per-example loss under `jax.vmap`; one key per layer (logged per example) plus the loss
   (49 keys);
7. eager calls: `eqx_logs.spool(f)(x)` without an outer jit against `eqx.filter_jit(f)(x)`
   and `jax.jit(f)(x)` for a tiny `f` with one log (per-call time after warm-up), and whether a
   new `eqx.Module` of the same structure retraces.

Targets: first call spool / hand <= 1.2x, trace spool / hand <= 3x, eager spool / filter_jit
<= 2x. Ratios are medians of the per-round ratios (robust to drifts in machine load).

Run from the repository root:

    python benchmarks/bench_compile.py [--quick] [--repeats N] [--rows straight,layers,...]

On 2 CPU cores `--quick` (fewer sizes, 3 repeats) takes about 1.5 minutes, the full run (9
repeats) about 15, most of it XLA compiling the 1000-site straight-line programs.

The script is a report: it exits 0 when a ratio misses its target (and prints MISS). It exits 1
only when spooled logs differ from the hand-written outputs, since the timings then compare
different work.
"""

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402

import eqx_logs  # noqa: E402

FIRST_CALL_TARGET = 1.2
TRACE_TARGET = 3.0
EAGER_TARGET = 2.0

WIDTH = 64
BATCH = 32
VEC = 16  # the carried vector of the straight-line and nested-scan cases
SCAN_LENGTH = 4  # of each level of the nested scans
TRAIN_STEPS = 4
TRAIN_BATCH = 8


# ----------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------


def count_eqns(jaxpr) -> int:
    """Equations of a jaxpr and of every sub-jaxpr in their params; a jit equation counts as
    its body only."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # ClosedJaxpr -> Jaxpr
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in ("pjit", "jit"):
            n += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += count_eqns(inner)
    return n


class Measured:
    """Timings (seconds) of one variant over the repeats, and its program sizes."""

    def __init__(self) -> None:
        self.trace: list[float] = []
        self.lower: list[float] = []
        self.compile: list[float] = []
        self.eqns = 0
        self.hlo_chars = 0
        self.xla_instrs = 0
        self.out = None  # the outputs of one call, for the equality check

    @property
    def first(self) -> list[float]:
        return [a + b + c for a, b, c in zip(self.trace, self.lower, self.compile)]


def stages(fn: Callable, args: tuple):
    """Trace, lower and compile `jax.jit(fn)` on `args`; returns the three times and the
    lowered and compiled stages."""
    gc.collect()
    gc.disable()
    try:
        jitted = jax.jit(fn)
        t0 = time.perf_counter()
        traced = jitted.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
    finally:
        gc.enable()
    return (t1 - t0, t2 - t1, t3 - t2), lowered, compiled


class Case:
    """One row: `make()` returns fresh `(spool_fn, hand_fn)`; `check(spool_out, hand_out)`
    asserts the two compute the same values."""

    def __init__(self, name: str, make: Callable, args: tuple, check: Callable) -> None:
        self.name = name
        self.make = make
        self.args = args
        self.check = check


def measure(case: Case, repeats: int, errors: list[str]) -> dict[str, Measured]:
    res = {"spool": Measured(), "hand": Measured()}
    names = list(res)
    # Round 0 is a warm-up (process-level lazy initialisation) and the equality check.
    for r in range(repeats + 1):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            jax.clear_caches()
            fn = dict(zip(names, case.make()))[name]
            times, lowered, compiled = stages(fn, case.args)
            m = res[name]
            if r == 0:
                m.hlo_chars = len(lowered.as_text())
                m.xla_instrs = bench_core.hlo_instruction_count(compiled.as_text())
                m.out = compiled(*case.args)
            else:
                m.trace.append(times[0])
                m.lower.append(times[1])
                m.compile.append(times[2])
    try:
        case.check(res["spool"].out, res["hand"].out)
    except AssertionError as e:
        errors.append(f"{case.name}: spooled logs != hand-written outputs: {e}")
        print(f"  *** ERROR {case.name}: spooled logs != hand-written outputs: {e}")
    for name in names:
        jax.clear_caches()
        fn = dict(zip(names, case.make()))[name]
        res[name].eqns = count_eqns(jax.make_jaxpr(fn)(*case.args))
        res[name].out = None
    return res


def print_table(title: str, rows: list[tuple[str, dict[str, Measured]]], misses: list) -> None:
    def cell(s: int, h: int) -> str:
        return f"{s}/{h} {s / h:.2f}x"

    def timing(sp: list[float], hd: list[float]) -> tuple[str, float]:
        ratio = bench_core.paired_ratio(sp, hd)
        return (
            f"{statistics.median(sp) * 1e3:.0f}/{statistics.median(hd) * 1e3:.0f} {ratio:.2f}x",
            ratio,
        )

    headers = (
        "case",
        "jaxpr eqns",
        "trace ms",
        "lower ms",
        "compile ms",
        "first call ms",
        f"first<={FIRST_CALL_TARGET}x",
        f"trace<={TRACE_TARGET:g}x",
        "HLO chars",
        "XLA instrs",
    )
    table = []
    for name, res in rows:
        s, h = res["spool"], res["hand"]
        trace, trace_ratio = timing(s.trace, h.trace)
        lower, _ = timing(s.lower, h.lower)
        comp, _ = timing(s.compile, h.compile)
        first, first_ratio = timing(s.first, h.first)
        first_ok = first_ratio <= FIRST_CALL_TARGET
        trace_ok = trace_ratio <= TRACE_TARGET
        for ok, what in ((first_ok, "first call"), (trace_ok, "trace")):
            if not ok:
                misses.append(f"{title.split(']')[0]}] {name}: {what}")
        table.append(
            (
                name,
                cell(s.eqns, h.eqns),
                trace,
                lower,
                comp,
                first,
                "OK" if first_ok else "MISS",
                "OK" if trace_ok else "MISS",
                cell(s.hlo_chars, h.hlo_chars),
                cell(s.xla_instrs, h.xla_instrs),
            )
        )
    widths = [max(len(r[i]) for r in [headers, *table]) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    print()
    print(title)
    print("    (each cell: spool/hand ratio; times are medians, ratios medians of paired ratios)")
    print(line)
    print("  ".join(c.ljust(w) for c, w in zip(headers, widths)).rstrip())
    print(line)
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(line)
    sys.stdout.flush()


def run_cases(title: str, cases: list[Case], repeats: int, errors: list[str], misses: list) -> None:
    t0 = time.perf_counter()
    rows = [(case.name, measure(case, repeats, errors)) for case in cases]
    print_table(f"{title}  ({time.perf_counter() - t0:.0f} s)", rows, misses)


def assert_close(a, b, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.size == b.size, f"{what}: shapes {a.shape} vs {b.shape}"
    assert np.allclose(a.ravel(), b.ravel(), rtol=1e-4, atol=1e-5), what


def check_dict(spool_out, hand_out) -> None:
    """`spool_out = (out, logs)`, `hand_out = (out, {key: value})`."""
    (out_s, logs), (out_h, ref) = spool_out, hand_out
    for a, b in zip(jax.tree.leaves(out_s), jax.tree.leaves(out_h), strict=True):
        assert_close(a, b, "output")
    assert sorted(logs) == sorted(ref), f"keys {sorted(logs)} vs {sorted(ref)}"
    for key in ref:
        assert_close(logs[key], ref[key], key)


# ----------------------------------------------------------------------------------------
# 1. Straight-line code
# ----------------------------------------------------------------------------------------


def straight_step(x):
    # cumsum lowers to a reduce_window, which XLA does not fuse into its elementwise
    # consumers: each site is a kernel of its own, as a layer would be. With an elementwise
    # step only (`jnp.sin(x) * 1.01`), XLA on CPU fuses a copy of the whole chain into every
    # stacked output: compile time grows quadratically (300 sites: 20-30 s, with or without
    # spool), which measures XLA rather than the logs.
    return jnp.sin(jnp.cumsum(x))


def make_straight(n: int, variant: str):
    def logged(x):
        for _ in range(n):
            x = straight_step(x)
            if variant == "multi":
                eqx_logs.log({"x": x, "mean": jnp.mean(x), "max": jnp.max(x)})
            else:
                eqx_logs.log({"x": x})
        return x

    def hand(x):
        xs, means, maxs = [], [], []
        mean = jnp.zeros_like(x)
        for i in range(n):
            x = straight_step(x)
            if variant == "mean":
                mean = mean + (x - mean) / (i + 1)
            else:
                xs.append(x)
            if variant == "multi":
                means.append(jnp.mean(x))
                maxs.append(jnp.max(x))
        if variant == "mean":
            return x, {"x": mean}
        if variant == "multi":
            return x, {"x": jnp.stack(xs), "mean": jnp.stack(means), "max": jnp.stack(maxs)}
        return x, {"x": jnp.stack(xs)}

    reduce = "mean" if variant == "mean" else None
    return eqx_logs.spool(logged, reduce=reduce), hand


def straight_cases(sizes: dict[str, list[int]]) -> list[Case]:
    x = jnp.linspace(-1.0, 1.0, VEC)
    cases = []
    for variant, label in (("one", "1 key"), ("multi", "3 keys"), ("mean", "1 key, mean")):
        for n in sizes[variant]:
            cases.append(
                Case(
                    f"{n} sites, {label}",
                    lambda n=n, v=variant: make_straight(n, v),
                    (x,),
                    check_dict,
                )
            )
    return cases


# ----------------------------------------------------------------------------------------
# 2, 3, 5. Layers: Python loop, lax.scan, jax.grad
# ----------------------------------------------------------------------------------------


def layer_stats(h) -> dict[str, jax.Array]:
    return {
        "mean": jnp.mean(h),
        "std": jnp.std(h),
        "rms": jnp.sqrt(jnp.mean(h**2)),
        "absmax": jnp.max(jnp.abs(h)),
        "norm": jnp.linalg.norm(h),
    }


def init_layers(n_layers: int, key: jax.Array) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, 2 * n_layers)
    return [
        {
            "w": jax.random.normal(keys[2 * i], (WIDTH, WIDTH)) / WIDTH**0.5,
            "b": 0.1 * jax.random.normal(keys[2 * i + 1], (WIDTH,)),
        }
        for i in range(n_layers)
    ]


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def make_loop_model(*, grad: bool = False):
    def logged(params, x):
        h = x
        for i, p in enumerate(params):
            h = layer(p, h)
            eqx_logs.log({f"layer{i}/{k}": v for k, v in layer_stats(h).items()})
        return jnp.mean(h**2)

    def hand(params, x):
        h, stats = x, {}
        for i, p in enumerate(params):
            h = layer(p, h)
            stats.update({f"layer{i}/{k}": v for k, v in layer_stats(h).items()})
        return jnp.mean(h**2), stats

    if grad:
        spooled = eqx_logs.spool(logged)
        return jax.grad(lambda p, x: spooled(p, x), has_aux=True), jax.grad(hand, has_aux=True)
    return eqx_logs.spool(logged), hand


def make_scan_model():
    def logged(params, x):
        def body(h, p):
            h = layer(p, h)
            eqx_logs.log(layer_stats(h))
            return h, None

        return jnp.mean(lax.scan(body, x, params)[0] ** 2)

    def hand(params, x):
        def body(h, p):
            h = layer(p, h)
            return h, layer_stats(h)

        h, stats = lax.scan(body, x, params)
        return jnp.mean(h**2), stats

    return eqx_logs.spool(logged), hand


def layer_cases(sizes: list[int], kind: str) -> list[Case]:
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    cases = []
    for n in sizes:
        params = init_layers(n, jax.random.key(0))
        if kind == "scan":
            params = jax.tree.map(lambda *a: jnp.stack(a), *params)
            make = make_scan_model
        elif kind == "grad":
            make = lambda: make_loop_model(grad=True)  # noqa: E731
        else:
            make = make_loop_model
        cases.append(Case(f"{n} layers", make, (params, x), check_dict))
    return cases


# ----------------------------------------------------------------------------------------
# 4. Nested scans
# ----------------------------------------------------------------------------------------


def make_nested(depth: int):
    js = jnp.arange(SCAN_LENGTH, dtype=jnp.float32) / SCAN_LENGTH

    def build(level: int, hand: bool):
        if level == depth - 1:

            def body(x, j):
                x = jnp.sin(x) * 1.01 + j
                if hand:
                    return x, x
                eqx_logs.log({"x": x})
                return x, None

        else:
            inner = build(level + 1, hand)

            def body(x, j):
                x, ys = lax.scan(inner, x + j, js)
                return x, ys

        return body

    def logged(x):
        return lax.scan(build(0, False), x, js)[0]

    def hand(x):
        x, ys = lax.scan(build(0, True), x, js)
        return x, {"x": ys.reshape(-1, VEC)}

    return eqx_logs.spool(logged), hand


def nested_cases(sizes: list[int]) -> list[Case]:
    x = jnp.linspace(-1.0, 1.0, VEC)
    return [
        Case(f"depth {d} ({SCAN_LENGTH**d} events)", lambda d=d: make_nested(d), (x,), check_dict)
        for d in sizes
    ]


# ----------------------------------------------------------------------------------------
# 6. Training loop: scan over steps of grad of a vmapped per-example loss
# ----------------------------------------------------------------------------------------


def make_train(n_layers: int):
    def example_forward(params, x, y, log: bool):
        h, stats = x, {}
        for i, p in enumerate(params):
            h = jnp.tanh(p["w"] @ h + p["b"])
            rms = jnp.sqrt(jnp.mean(h**2))
            if log:
                eqx_logs.log({f"layer{i:02d}/rms": rms})
            stats[f"layer{i:02d}/rms"] = rms
        return jnp.mean((h - y) ** 2), stats

    def logged(params, xs, ys):
        def batch_loss(params, x, y):
            losses, _ = jax.vmap(lambda x, y: example_forward(params, x, y, True))(x, y)
            return jnp.mean(losses)

        def step(params, batch):
            loss, grads = jax.value_and_grad(batch_loss)(params, *batch)
            eqx_logs.log({"loss": loss})
            return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), None

        return lax.scan(step, params, (xs, ys))[0]

    def hand(params, xs, ys):
        def batch_loss(params, x, y):
            losses, stats = jax.vmap(lambda x, y: example_forward(params, x, y, False))(x, y)
            return jnp.mean(losses), stats

        def step(params, batch):
            (loss, stats), grads = jax.value_and_grad(batch_loss, has_aux=True)(params, *batch)
            return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), {**stats, "loss": loss}

        return lax.scan(step, params, (xs, ys))

    return eqx_logs.spool(logged), hand


def train_cases(n_layers: int) -> list[Case]:
    params = init_layers(n_layers, jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (TRAIN_STEPS, TRAIN_BATCH, WIDTH))
    ys = jnp.sin(xs)
    return [
        Case(
            f"{n_layers} layers, {n_layers + 1} keys, {TRAIN_STEPS} steps x batch {TRAIN_BATCH}",
            lambda: make_train(n_layers),
            (params, xs, ys),
            check_dict,
        )
    ]


# ----------------------------------------------------------------------------------------
# 7. Eager calls: spool(f)(x) without an outer jit
# ----------------------------------------------------------------------------------------


class Tiny(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        return tiny_apply(self, x)


TRACES = [0]


def tiny(x):
    TRACES[0] += 1
    eqx_logs.log({"x": x})
    return x * 2 + 1


def tiny_apply(m, x):
    TRACES[0] += 1
    y = m.w * x + m.b
    eqx_logs.log({"y": y})
    return y


def retraces(call: Callable[[Tiny], object]) -> str:
    """Calls `call` on two different modules of one structure: did the second call retrace
    `f`, and how long did it take, against a repeated call on the same module?"""
    m1 = Tiny(jnp.ones(8, jnp.float32), jnp.zeros(8, jnp.float32))
    m2 = Tiny(jnp.full(8, 2.0, jnp.float32), jnp.ones(8, jnp.float32))
    jax.block_until_ready(call(m1))
    jax.block_until_ready(call(m1))
    before = TRACES[0]
    t0 = time.perf_counter()
    jax.block_until_ready(call(m2))
    t1 = time.perf_counter()
    jax.block_until_ready(call(m2))
    t2 = time.perf_counter()
    again = "yes" if TRACES[0] > before else "no"
    return f"{again:<3}  (call on it {(t1 - t0) * 1e3:7.2f} ms, again {(t2 - t1) * 1e3:5.2f} ms)"


def bench_eager(repeats: int, calls: int, misses: list) -> None:
    t_start = time.perf_counter()
    print("\n[7] eager calls of a tiny f with one log: spool(f)(x) without an outer jit")
    x = jnp.arange(8, dtype=jnp.float32)
    spooled = eqx_logs.spool(tiny)
    fj = eqx.filter_jit(tiny)
    jj = jax.jit(tiny)
    out, logs = spooled(x)
    assert_close(logs["x"], x, "eager logs")
    assert_close(out, fj(x), "eager output")

    def inline(x):  # a new spool object every call, the same f
        return eqx_logs.spool(tiny)(x)

    variants = {
        "spool(f)(x)": bench_core.dispatch_loop(spooled, x, calls),
        "eqx.filter_jit(f)(x)": bench_core.dispatch_loop(fj, x, calls),
        "jax.jit(f)(x)": bench_core.dispatch_loop(jj, x, calls),
        "spool(f) made at every call": bench_core.dispatch_loop(inline, x, calls),
    }
    times = bench_core.interleaved(variants, repeats)
    per_call = {k: [t / calls for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in per_call.items()}
    for name, t in med.items():
        print(f"    {name:<30} {t * 1e6:8.1f} us per call (median of {repeats} x {calls} calls)")
    ratio = bench_core.paired_ratio(per_call["spool(f)(x)"], per_call["eqx.filter_jit(f)(x)"])
    ok = ratio <= EAGER_TARGET
    if not ok:
        misses.append("[7] eager spool / filter_jit")
    print(
        f"    ratio spool / filter_jit: {ratio:.2f}x (target <= {EAGER_TARGET:g}x): "
        f"{'OK' if ok else 'MISS'}"
    )
    print(
        f"    ratio spool / jax.jit: "
        f"{bench_core.paired_ratio(per_call['spool(f)(x)'], per_call['jax.jit(f)(x)']):.2f}x"
    )

    fjm = eqx.filter_jit(tiny_apply)
    sp = eqx_logs.spool(tiny_apply)
    for what, call in (
        ("spool(f)(module, x)", lambda m: sp(m, x)),
        ("spool(module)(x)", lambda m: eqx_logs.spool(m)(x)),
        ("jax.jit(spool(module))(x)", lambda m: jax.jit(eqx_logs.spool(m))(x)),
        ("context: eqx.filter_jit(f)(module, x)", lambda m: fjm(m, x)),
        ("context: eqx.filter_jit(module)(x)", lambda m: eqx.filter_jit(m)(x)),
    ):
        print(f"    {what:<38} retrace on new module: {retraces(call)}")
    print(
        "    (jax.jit hashes the callable by identity: a new spool(module) is a new function "
        "to it,\n     lowered and compiled again, even where spool's own cache spares a retrace "
        "of f)"
    )
    print(f"    ({time.perf_counter() - t_start:.0f} s)")


# ----------------------------------------------------------------------------------------


ROWS = ("straight", "layers", "scan", "nested", "grad", "train", "eager")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, 3 repeats (~1.5 min)")
    parser.add_argument("--repeats", type=int, default=None, help="default 9 (3 with --quick)")
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"comma-separated subset of {','.join(ROWS)} (default: all)",
    )
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    repeats = args.repeats or (3 if args.quick else 9)
    if args.quick:
        straight = {"one": [100, 300], "multi": [100], "mean": [100]}
        layers, depths, train_layers = [4, 16], [1, 2], 48
        eager_repeats, calls = 5, 200
    else:
        # 3 stacks of 1000 events take minutes to compile per measurement, spool or not.
        straight = {"one": [100, 300, 1000], "multi": [100, 300], "mean": [100, 300, 1000]}
        layers, depths, train_layers = [4, 16, 48], [1, 2, 4], 48
        eager_repeats, calls = 15, 1000

    import jaxlib

    devices = jax.devices()
    print("eqx_logs compile-cost benchmarks" + (" (--quick)" if args.quick else ""))
    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, equinox {eqx.__version__}, "
        f"eqx_logs {eqx_logs.__version__}, python {platform.python_version()}"
    )
    print(
        f"backend {jax.default_backend()}: {devices[0].device_kind} x{len(devices)}, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}; {repeats} repeats"
    )
    t_start = time.perf_counter()
    errors: list[str] = []
    misses: list[str] = []
    if "straight" in rows:
        run_cases(
            "[1] straight-line code: x = sin(cumsum(x)); log(...) at every site (x: f32[16])",
            straight_cases(straight),
            repeats,
            errors,
            misses,
        )
    if "layers" in rows:
        run_cases(
            f"[2] MLP as a Python loop (width {WIDTH}, batch {BATCH}), 5 stats/layer, own keys",
            layer_cases(layers, "loop"),
            repeats,
            errors,
            misses,
        )
    if "scan" in rows:
        run_cases(
            "[3] the same layers in lax.scan (weights stacked), 5 stats under fixed keys",
            layer_cases(layers, "scan"),
            repeats,
            errors,
            misses,
        )
    if "nested" in rows:
        run_cases(
            f"[4] nested lax.scan, length {SCAN_LENGTH} per level, log in the innermost body",
            nested_cases(depths),
            repeats,
            errors,
            misses,
        )
    if "grad" in rows:
        run_cases(
            "[5] jax.grad(has_aux=True) of the Python-loop model of [2], spool inside the grad",
            layer_cases(layers, "grad"),
            repeats,
            errors,
            misses,
        )
    if "train" in rows:
        run_cases(
            "[6] training loop: scan over SGD steps of grad of a vmapped per-example loss",
            train_cases(train_layers),
            repeats,
            errors,
            misses,
        )
    if "eager" in rows:
        bench_eager(eager_repeats, calls, misses)

    return bench_core.report_end(misses, errors, t_start)


if __name__ == "__main__":
    sys.exit(main())
