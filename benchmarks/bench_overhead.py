"""What logging costs: µs per step, and the ratio to the same program without logging, by
interval and payload, for each way of logging a training step.

The program: a training-like step on a 64x64 weight `w` (the gradient of a two-layer loss
with the weight shared, about six 64x64 matmuls, and an SGD update). The payload is computed
from the updated weight, so that it cannot be constant-folded: a float32 scalar (its norm),
1 KiB (`tanh` of 256 of its entries) or 1 MiB (262,144 products `w[a, b] * w[b, c]`),
logged with `step=i` and kept every `interval`-th step (1, 10, 100, 1000).

Forms, on the same step (`update`, below):

- in a `lax.scan` over the steps (baseline: the scan without logging, `jax.jit`):
  `jax.jit(eqx_logs.spool(scan, interval=k))` (logs returned and blocked on),
  `jax.jit(eqx_logs.tap(scan, interval=k, callback=...))` (a callback that counts events),
  and jax-tap's `jax.jit(jaxtap.verbose(scan, on_step=..., select=..., sample_every=k))`
  (its wrap-the-callable form: `select` computes the payload from the carry on the device,
  `sample_every` gates the callback with a `lax.cond`);
- in a Python loop calling one compiled step per step (baseline: `eqx.filter_jit(step)`
  without logging), written to a `JsonlLogger` (an `ArrayLogger` for 1 MiB: a million floats
  as JSON text is not a sensible choice): `logger.jit(step, state, interval=k)`,
  `eqx.filter_jit(eqx_logs.spool(step, interval=k))` then `logger.write(logs, state)`,
  `eqx.filter_jit(logger.spool(step, ...))`, `eqx.filter_jit(logger.tap(step, ...))`; a
  `jax.debug.callback` under `lax.cond(i % k == 0, ...)` appending to a list; and the habit
  by hand: the step returns the payload, every k-th step the loop writes `np.asarray` of it
  (a JSON line, or a `.npy` file for 1 MiB). jax-tap has no form for this loop: it taps the
  carries of `lax.scan`/`while_loop` (its primitive taps outside a loop fire on every call,
  with no `sample_every`), so its row says n/a. For context, the loop without logging under
  `jax.jit(step)` (every eqx_logs form there, `logger.jit` included, dispatches through
  `eqx.filter_jit`, whose Python dispatch costs more per call than `jax.jit`'s).

Each cell runs every form of one loop shape in interleaved rounds (the order rotated each
round); the ratio is the median of the per-round ratios to that shape's baseline, the µs per
step the median time over the number of steps. The step numbers of the per-step loop are
device arrays made before the loop (so the loop times dispatch and logging only). Writes are
waited for: `logger.flush()`, `jax.effects_barrier()`. Before the timed rounds each form runs
once and is checked: the kept steps are 0, k, 2k, ... and the values those of the hand-written
form (within float32 rounding); for jax-tap the number of events and their steps as well.
1 MiB runs at most 100 events (`min(steps, 100 * k)` steps), so that a run writes at most
100 MiB. Exits 1 if a check fails.

Run from the repository root: `python benchmarks/bench_overhead.py [--quick]`.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_logs
from eqx_logs.loggers import ArrayLogger, JsonlLogger, read_arrays, read_jsonl

try:
    import jaxtap
except ImportError:  # the `bench` extra: pip install '.[bench]'
    jaxtap = None

PAYLOADS = {"scalar": 1, "1 KiB": 256, "1 MiB": 262_144}
BIG = 262_144  # written with ArrayLogger (and .npy by hand) instead of JSONL
BIG_EVENTS = 100  # at most this many 1 MiB events a run
WIDTH, LR = 64, 0.05

SCAN_BASE, LOOP_BASE = "scan: no logging (jax.jit)", "loop: no logging (eqx.filter_jit)"
HAND = "loop: by hand (return payload, write every k-th)"
SCAN_FORMS = (SCAN_BASE, "scan: jit(spool)", "scan: jit(tap)", "scan: jax-tap verbose")
LOOP_FORMS = (
    LOOP_BASE,
    "loop: jax.jit(step), no logging (context)",
    "loop: logger.jit",
    "loop: filter_jit(spool) + logger.write",
    "loop: filter_jit(logger.spool)",
    "loop: filter_jit(logger.tap)",
    "loop: debug.callback under lax.cond",
    HAND,
    "loop: jax-tap",
)


def update(w, x, y):
    """A training step: the gradient of a two-layer loss sharing `w`, then SGD."""

    def loss(w):
        return jnp.mean((jnp.tanh(x @ w) @ w - y) ** 2)

    return w - LR * jax.grad(loss)(w)


def payload(w, size: int):
    if size == 1:
        return jnp.sqrt(jnp.sum(w * w))
    if size == 256:
        return jnp.tanh(w[:4]).reshape(256)
    return (w[:, :, None] * w[None, :, :]).reshape(-1)  # 64 ** 3 = 262,144


@dataclasses.dataclass
class Form:
    """One way of running the loop: `run` is timed, `reset` (untimed) clears what the last run
    left, `events` gives the kept (steps, values) of the last run, `close` ends it."""

    run: Callable[[], None]
    events: Callable[[], tuple[list[int], list[np.ndarray]]] | None = None
    reset: Callable[[], None] = lambda: None
    close: Callable[[], None] = lambda: None


class Sink:
    """A host callback's list of events; `keep=False` only counts them."""

    def __init__(self):
        self.n, self.keep, self.items = 0, True, []

    def add(self, step, value):
        self.n += 1
        if self.keep:
            self.items.append((int(step), np.asarray(value)))

    def clear(self, keep: bool):
        self.n, self.keep, self.items = 0, keep, []

    def events(self):
        return [s for s, _ in self.items], [v for _, v in self.items]


def problem():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (WIDTH, WIDTH))
    y = jax.random.normal(keys[1], (WIDTH, WIDTH))
    w0 = jax.random.normal(keys[2], (WIDTH, WIDTH)) / WIDTH**0.5
    return w0, x, y


def scan_forms(size: int, k: int, steps: int) -> dict[str, Form]:
    w0, x, y = problem()
    idx = jnp.arange(steps, dtype=jnp.int32)

    def scan(w, idx, log: bool):
        def body(w, i):
            w = update(w, x, y)
            if log:
                eqx_logs.log({"p": payload(w, size)}, step=i)
            return w, None

        return jax.lax.scan(body, w, idx)[0]

    plain = jax.jit(functools.partial(scan, log=False))
    logged = functools.partial(scan, log=True)

    def run_plain():
        jax.block_until_ready(plain(w0, idx))
        jax.effects_barrier()

    spooled = jax.jit(eqx_logs.spool(logged, interval=k))
    last = {}

    def run_spool():
        last["logs"] = jax.block_until_ready(spooled(w0, idx))[1]
        jax.effects_barrier()

    def spool_events():
        logs = last["logs"]
        n = int(logs.count["p"])
        steps_ = np.asarray(logs.steps["step"]["p"])[:n]
        return [int(s) for s in steps_], list(np.asarray(logs["p"])[:n])

    tap_sink = Sink()
    tapped = jax.jit(
        eqx_logs.tap(logged, interval=k, callback=lambda lg, st: tap_sink.add(st["step"], lg["p"]))
    )

    def run_tapped(fn):
        def go():
            jax.block_until_ready(fn(w0, idx))
            jax.effects_barrier()

        return go

    forms = {
        SCAN_BASE: Form(run_plain),
        "scan: jit(spool)": Form(run_spool, spool_events),
        "scan: jit(tap)": Form(
            run_tapped(tapped), tap_sink.events, lambda: tap_sink.clear(keep=False)
        ),
    }
    if jaxtap is not None:
        jt_sink = Sink()
        jt = jax.jit(
            jaxtap.verbose(
                functools.partial(scan, log=False),
                on_step=lambda e: jt_sink.add(e.step, e.value),
                select=lambda leaves: payload(leaves[0], size),
                sample_every=k,
            )
        )
        forms["scan: jax-tap verbose"] = Form(
            run_tapped(jt), jt_sink.events, lambda: jt_sink.clear(keep=False)
        )
    return forms


def loop_forms(size: int, k: int, steps: int, tmp: str) -> dict[str, Form]:
    w0, x, y = problem()
    idx = jax.block_until_ready([jnp.int32(i) for i in range(steps)])
    big = size == BIG

    def step(w, i):
        return update(w, x, y)

    def step_logged(w, i):
        w = update(w, x, y)
        eqx_logs.log({"p": payload(w, size)}, step=i)
        return w

    def loop(fn: Callable) -> Callable[[], None]:
        """The per-step loop of `fn`, a compiled step that writes nothing itself."""

        def run():
            w = w0
            for i in idx:
                w = fn(w, i)
            jax.block_until_ready(w)
            jax.effects_barrier()

        return run

    forms = {LOOP_BASE: Form(loop(eqx.filter_jit(step)))}
    # for context: the same loop without Equinox's filtered dispatch
    forms["loop: jax.jit(step), no logging (context)"] = Form(loop(jax.jit(step)))

    def with_logger(name: str, make: Callable, writes: bool = False):
        path = os.path.join(tmp, f"{len(forms)}")
        logger = ArrayLogger(path) if big else JsonlLogger(path + ".jsonl")
        state = logger.init()
        fn = make(logger, state)

        def run():
            w = w0
            for i in idx:
                if writes:
                    w, logs = fn(w, i)
                    logger.write(logs, state)
                else:
                    w = fn(w, i)
            jax.block_until_ready(w)
            logger.flush()

        def events():
            if big:
                rows = read_arrays(path).get("p", [])
                return [int(r["step/step"]) for r in rows], [r["value"] for r in rows]
            rows = [r for r in read_jsonl(path + ".jsonl") if r["key"] == "p"]
            return [r["step"] for r in rows], [np.asarray(r["value"], np.float32) for r in rows]

        def reset():  # 1 MiB files: keep the disk use of a run at most 100 MiB
            if big and os.path.isdir(os.path.join(path, "run_0")):
                for root, _, files in os.walk(os.path.join(path, "run_0")):
                    for f in files:
                        os.remove(os.path.join(root, f))

        forms[name] = Form(run, events, reset, logger.close)

    with_logger("loop: logger.jit", lambda lg, s: lg.jit(step_logged, s, interval=k))
    spooled = eqx.filter_jit(eqx_logs.spool(step_logged, interval=k))
    with_logger("loop: filter_jit(spool) + logger.write", lambda lg, s: spooled, writes=True)
    with_logger(
        "loop: filter_jit(logger.spool)",
        lambda lg, s: eqx.filter_jit(lg.spool(step_logged, s, interval=k)),
    )
    with_logger(
        "loop: filter_jit(logger.tap)",
        lambda lg, s: eqx.filter_jit(lg.tap(step_logged, s, interval=k)),
    )

    cb_sink = Sink()

    def step_callback(w, i):
        w = update(w, x, y)
        jax.lax.cond(
            i % k == 0,
            lambda w: jax.debug.callback(cb_sink.add, i, payload(w, size)),
            lambda w: None,
            w,
        )
        return w

    # the debug.callback appends each event to a list (kept, as a user would)
    forms["loop: debug.callback under lax.cond"] = Form(
        loop(eqx.filter_jit(step_callback)), cb_sink.events, lambda: cb_sink.clear(keep=True)
    )

    def step_returning(w, i):
        w = update(w, x, y)
        return w, payload(w, size)

    hand_step = eqx.filter_jit(step_returning)
    hand_dir = os.path.join(tmp, "by_hand")
    os.makedirs(hand_dir)

    def run_hand():
        w = w0
        with open(os.path.join(hand_dir, "run.jsonl"), "w") as f:
            for n, i in enumerate(idx):
                w, p = hand_step(w, i)
                if n % k == 0:
                    value = np.asarray(p)
                    if big:
                        np.save(os.path.join(hand_dir, f"{n:06d}.npy"), value)
                    else:
                        f.write(json.dumps({"key": "p", "value": value.tolist(), "step": n}))
                        f.write("\n")
        jax.block_until_ready(w)

    def hand_events():
        if big:
            names = sorted(f for f in os.listdir(hand_dir) if f.endswith(".npy"))
            return [int(f[:6]) for f in names], [np.load(os.path.join(hand_dir, f)) for f in names]
        with open(os.path.join(hand_dir, "run.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        return [r["step"] for r in rows], [np.asarray(r["value"], np.float32) for r in rows]

    def hand_reset():
        for f in os.listdir(hand_dir):
            os.remove(os.path.join(hand_dir, f))

    forms[HAND] = Form(run_hand, hand_events, hand_reset)
    return forms


def check(name: str, got, want_steps, reference, failures: list[str], label: str) -> None:
    steps, values = got
    if list(steps) != list(want_steps):
        failures.append(f"{label}, {name}: steps {list(steps)[:8]}... != {list(want_steps)[:8]}...")
        return
    if reference is None:
        return
    for s, v, r in zip(steps, values, reference):
        if not np.allclose(np.asarray(v, np.float32), r, rtol=1e-4, atol=1e-5):
            err = np.max(np.abs(np.asarray(v, np.float32) - r))
            failures.append(f"{label}, {name}: value at step {s} differs (max abs {err:.3g})")
            return


def measure(forms: dict[str, Form], base: str, rounds: int, steps: int):
    """Interleaved rounds, the order rotated each round: µs per step (median) and the median
    of the per-round ratios to `base`."""
    names = list(forms)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            forms[n].reset()
            start = time.perf_counter()
            forms[n].run()
            times[n].append(time.perf_counter() - start)
    out = {}
    for n in names:
        ratio = statistics.median(t / b for t, b in zip(times[n], times[base]))
        out[n] = (statistics.median(times[n]) / steps * 1e6, ratio)
    return out


def cell(size: int, k: int, steps: int, rounds: int, failures: list[str]):
    label = f"payload {size} float32, interval {k}"
    want = list(range(0, steps, k))
    tmp = tempfile.mkdtemp(prefix="bench_overhead_")
    results = {}
    try:
        loop = loop_forms(size, k, steps, tmp)
        hand = loop[HAND]
        hand.run()  # compile, and the reference values
        ref_steps, reference = hand.events()
        check("by hand", (ref_steps, reference), want, None, failures, label)
        reference = [np.asarray(v, np.float32) for v in reference]
        if list(ref_steps) != want:
            reference = None
        for name, form in loop.items():
            if name == HAND:
                continue
            form.reset()
            form.run()  # compile, warm up
            if form.events is not None:
                check(name, form.events(), want, reference, failures, label)
        scan = scan_forms(size, k, steps)
        for name, form in scan.items():
            form.run()
            if form.events is not None:
                check(name, form.events(), want, reference, failures, label)
        results.update(measure(scan, SCAN_BASE, rounds, steps))
        results.update(measure(loop, LOOP_BASE, rounds, steps))
        for form in loop.values():
            form.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def table(name: str, size: int, intervals, results, steps_of) -> str:
    writer = "ArrayLogger (.npz files)" if size == BIG else "JsonlLogger"
    hand = ".npy files" if size == BIG else "JSON lines"
    lines = [
        f"**{name}** ({size} float32; per-step loop written with {writer}, by hand as {hand}; "
        + ", ".join(f"interval {k}: {steps_of(size, k)} steps" for k in intervals)
        + ")",
        "",
        "| form | " + " | ".join(f"interval {k}" for k in intervals) + " |",
        "|---|" + "---|" * len(intervals),
    ]
    for form in SCAN_FORMS + LOOP_FORMS:
        cells = []
        for k in intervals:
            r = results.get((size, k), {}).get(form)
            if r is None:
                cells.append("n/a")
            elif form in (SCAN_BASE, LOOP_BASE):
                cells.append(f"{r[0]:.1f} µs")
            else:
                cells.append(f"{r[0]:.1f} µs ({r[1]:.2f}x)")
        lines.append(f"| {form} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps, rounds and intervals")
    args = parser.parse_args()
    total = 200 if args.quick else 1000
    rounds = 3 if args.quick else 5
    intervals = (1, 100) if args.quick else (1, 10, 100, 1000)

    def steps_of(size: int, k: int) -> int:
        return min(total, BIG_EVENTS * k) if size == BIG else total

    jt = metadata.version("jax-tap") if jaxtap is not None else "not installed (n/a)"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (load average {load}); Python {platform.python_version()}, "
        f"jax {jax.__version__}, {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); "
        f"eqx_logs {eqx_logs.__version__}, jax-tap {jt}"
    )
    print(
        f"{'quick' if args.quick else 'full'} mode: {total} steps, median of {rounds} "
        "interleaved rounds; µs per step (ratio to the same loop shape without logging)\n",
        flush=True,
    )
    start = time.perf_counter()
    failures: list[str] = []
    results = {}
    for name, size in PAYLOADS.items():
        for k in intervals:
            t = time.perf_counter()
            results[(size, k)] = cell(size, k, steps_of(size, k), rounds, failures)
            print(f"  {name}, interval {k}: {time.perf_counter() - t:.0f} s", flush=True)
    print()
    for name, size in PAYLOADS.items():
        print(table(name, size, intervals, results, steps_of) + "\n")
    print(f"total {time.perf_counter() - start:.0f} s")
    if failures:
        print("\nCORRECTNESS CHECKS FAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print("every form checked: kept steps 0, k, 2k, ... and values as written by hand")
    return 0


if __name__ == "__main__":
    sys.exit(main())
