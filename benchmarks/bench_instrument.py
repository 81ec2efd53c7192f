"""Cost of `eqx_logs.instrument(model, grads=True)` in a transformer training step.

The model: a 4-layer pre-LayerNorm transformer (d_model 128, 4 heads, MLP width 512; blocks of
`eqx.nn.LayerNorm`, `eqx.nn.MultiheadAttention` and two `eqx.nn.Linear`s) over sequences of 64
tokens, `jax.vmap`ped over a batch of 16 inside a cross-entropy loss, trained with
`optax.adam(1e-3)`. The step is `eqx.filter_jit` of `(model, opt_state, x, y) -> (model,
opt_state, loss)`. Two variants, on the same weights and batch:

- plain: the step on the plain model;
- instrumented: the same step body under `eqx_logs.spool(step_body, reduce="mean")` inside
  the jitted step (which also returns the LogDict), on `eqx_logs.instrument(model,
  grads=True)` with the default statistics (mean, std, rms, absmax, nonfinite of every
  submodule's output and of its cotangent); the optimiser state is made from the
  instrumented model.

Measured:

1. memory of the compiled step: temp + output bytes of `memory_analysis()` of
   `step.lower(*args).compile()`. Target: instrumented / plain <= 1.1x;
2. runtime per step after warm-up: the two variants interleaved (the order alternates every
   round), each round timing a few calls ending in `jax.block_until_ready`; the ratio is the
   median of the per-round ratios. Target: instrumented / plain <= 1.2x.

Also printed: the number of logged keys and their shapes (under `jax.vmap` each lane has its
own statistics), the compile times, and an equality check: the instrumented step's new model,
optimiser state and loss must equal the plain step's (`np.allclose`), since both compute the
same thing.

Run from the repository root:

    python benchmarks/bench_instrument.py [--quick] [--repeats N]

On 2 CPU cores `--quick` (5 repeats of 2 calls) takes about a minute, most of it compiling the
two steps; the default is 15 repeats of 3 calls.

The script is a report: it exits 0 when a ratio misses its target (and prints MISS). It exits 1
only when the instrumented and plain steps disagree, since the numbers then compare different
work.
"""

import argparse
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
import optax

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402

import eqx_logs  # noqa: E402

MEMORY_TARGET = 1.1
RUNTIME_TARGET = 1.2

LAYERS = 4
D_MODEL = 128
HEADS = 4
MLP_WIDTH = 4 * D_MODEL
SEQ = 64
BATCH = 16
VOCAB = 256
LR = 1e-3


# ----------------------------------------------------------------------------------------
# Model and step
# ----------------------------------------------------------------------------------------


class Block(eqx.Module):
    """Pre-LayerNorm transformer block; `x`: (seq, d_model)."""

    ln1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(D_MODEL)
        self.attention = eqx.nn.MultiheadAttention(HEADS, D_MODEL, key=k1)
        self.ln2 = eqx.nn.LayerNorm(D_MODEL)
        self.up = eqx.nn.Linear(D_MODEL, MLP_WIDTH, key=k2)
        self.down = eqx.nn.Linear(MLP_WIDTH, D_MODEL, key=k3)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class Transformer(eqx.Module):
    """Causal language model; `tokens`: int (seq,) -> logits (seq, vocab)."""

    embedding: eqx.nn.Embedding
    position: jax.Array
    blocks: list[Block]
    ln_final: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        keys = jax.random.split(key, LAYERS + 3)
        self.embedding = eqx.nn.Embedding(VOCAB, D_MODEL, key=keys[0])
        self.position = 0.02 * jax.random.normal(keys[1], (SEQ, D_MODEL))
        self.blocks = [Block(k) for k in keys[2:-1]]
        self.ln_final = eqx.nn.LayerNorm(D_MODEL)
        self.head = eqx.nn.Linear(D_MODEL, VOCAB, key=keys[-1])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embedding)(tokens) + self.position
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.ln_final)(x))


def loss_fn(model: Transformer, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


OPTIM = optax.adam(LR)


def step_body(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = OPTIM.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


plain_step = eqx.filter_jit(step_body)

spooled_body = eqx_logs.spool(step_body, reduce="mean")


@eqx.filter_jit
def instrumented_step(model, opt_state, x, y):
    (model, opt_state, loss), logs = spooled_body(model, opt_state, x, y)
    return model, opt_state, loss, logs


# ----------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory(step: Callable, args: tuple) -> tuple[dict[str, int], float]:
    """Sizes from `memory_analysis()` of `step.lower(*args).compile()` (`step` an
    `eqx.filter_jit` function), and the lower + compile time."""
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    seconds = time.perf_counter() - t0
    # equinox's `Compiled` wraps jax's (`.compiled`), which has `memory_analysis()`
    m = getattr(compiled, "compiled", compiled).memory_analysis()
    fields = ("argument", "output", "temp", "alias", "generated_code")
    return {f: int(getattr(m, f"{f}_size_in_bytes", 0)) for f in fields}, seconds


def leaves_close(a, b) -> list[str]:
    """Paths (as keystr) at which two pytrees of the same leaves differ."""
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    if len(la) != len(lb):
        return [f"{len(la)} leaves against {len(lb)}"]
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(eqx.filter(b, eqx.is_array))[0]
    ]
    return [
        path
        for path, u, v in zip(paths, la, lb)
        if u.shape != v.shape or not np.allclose(u, v, rtol=1e-5, atol=1e-6)
    ]


def calls_of(step: Callable, args: tuple, calls: int) -> Callable[[], None]:
    def run() -> None:
        out = None
        for _ in range(calls):
            out = step(*args)
        jax.block_until_ready(out)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats of 2 calls (~1 min)")
    parser.add_argument("--repeats", type=int, default=None, help="default 15 (5 with --quick)")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    calls = 2 if args.quick else 3

    import jaxlib

    devices = jax.devices()
    print("eqx_logs instrument benchmark" + (" (--quick)" if args.quick else ""))
    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, equinox {eqx.__version__}, "
        f"optax {optax.__version__}, eqx_logs {eqx_logs.__version__}, "
        f"python {platform.python_version()}"
    )
    print(
        f"backend {jax.default_backend()}: {devices[0].device_kind} x{len(devices)}, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}; {repeats} repeats x {calls} calls"
    )
    print(
        f"\n{LAYERS}-layer pre-LN transformer, d_model {D_MODEL}, {HEADS} heads, MLP "
        f"{MLP_WIDTH}, seq {SEQ}, batch {BATCH}, vocab {VOCAB}; adam; eqx.filter_jit step"
    )
    t_start = time.perf_counter()

    model = Transformer(jax.random.key(0))
    imodel = eqx_logs.instrument(model, grads=True)
    x = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    y = jnp.roll(x, -1, axis=1)
    opt_state = OPTIM.init(eqx.filter(model, eqx.is_array))
    iopt_state = OPTIM.init(eqx.filter(imodel, eqx.is_array))
    n_params = sum(p.size for p in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(f"{n_params} parameters")
    plain_args = (model, opt_state, x, y)
    instr_args = (imodel, iopt_state, x, y)

    # 1. Memory of the compiled steps (and the compile times).
    mem = {}
    compile_s = {}
    for name, step, step_args in (
        ("plain", plain_step, plain_args),
        ("instrumented", instrumented_step, instr_args),
    ):
        mem[name], compile_s[name] = memory(step, step_args)

    # The check: both steps compute the same new model, optimiser state and loss.
    errors: list[str] = []
    p_model, p_opt, p_loss = plain_step(*plain_args)
    i_model, i_opt, i_loss, logs = instrumented_step(*instr_args)
    for what, a, b in (
        ("model", i_model, p_model),
        ("optimiser state", i_opt, p_opt),
        ("loss", i_loss, p_loss),
    ):
        bad = leaves_close(a, b)
        if bad:
            errors.append(f"instrumented {what} != plain {what} at {bad[:5]}")
    n_keys = len(logs)
    grad_keys = sum("/grad/" in k for k in logs)
    shapes: dict[tuple, int] = {}
    for k in logs:
        shapes[logs[k].shape] = shapes.get(logs[k].shape, 0) + 1
    log_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(logs))
    print(
        f"loss {float(p_loss):.4f} (plain), {float(i_loss):.4f} (instrumented); "
        f"steps agree: {not errors}"
    )
    print(
        f"{n_keys} logged keys ({n_keys - grad_keys} forward, {grad_keys} '/grad/'); "
        f"shapes: " + ", ".join(f"{s} x{n}" for s, n in sorted(shapes.items())) + "; "
        f"LogDict {mib(log_bytes)}"
    )

    print("\n[1] compiled step, memory_analysis()")
    for name in mem:
        m = mem[name]
        print(
            f"    {name:<13} temp {mib(m['temp']):>11}  output {mib(m['output']):>11}  "
            f"argument {mib(m['argument']):>11}  (lower + compile {compile_s[name]:.1f} s)"
        )
    tot = {name: m["temp"] + m["output"] for name, m in mem.items()}
    mem_ratio = tot["instrumented"] / tot["plain"]
    temp_ratio = mem["instrumented"]["temp"] / max(mem["plain"]["temp"], 1)
    mem_ok = mem_ratio <= MEMORY_TARGET
    print(
        f"    temp + output: {mib(tot['instrumented'])} / {mib(tot['plain'])} = "
        f"{mem_ratio:.3f}x (target <= {MEMORY_TARGET:g}x): {'OK' if mem_ok else 'MISS'}"
    )
    print(f"    temp alone: {temp_ratio:.3f}x")

    # 2. Runtime per step, interleaved.
    print(f"\n[2] runtime per step ({repeats} rounds of {calls} calls, order alternating)")
    times = bench_core.interleaved(
        {
            "plain": calls_of(plain_step, plain_args, calls),
            "instrumented": calls_of(instrumented_step, instr_args, calls),
        },
        repeats,
    )
    for name, ts in times.items():
        per_step = bench_core.fmt_time(statistics.median(ts) / calls)
        print(f"    {name:<13} median {per_step} per step")
    run_ratio = bench_core.paired_ratio(times["instrumented"], times["plain"])
    run_ok = run_ratio <= RUNTIME_TARGET
    print(
        f"    instrumented / plain: {run_ratio:.3f}x (median of per-round ratios; target <= "
        f"{RUNTIME_TARGET:g}x): {'OK' if run_ok else 'MISS'}"
    )

    misses = [
        name
        for name, ok in (("[1] memory temp + output", mem_ok), ("[2] runtime", run_ok))
        if not ok
    ]
    return bench_core.report_end(misses, errors, t_start)


if __name__ == "__main__":
    sys.exit(main())
