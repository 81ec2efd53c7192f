"""Per-example gradient norms (`eqx_logs.value_grad_and_norms`): one training step, side by
side in one run, of two models: a transformer block (a sequence axis: attention, LayerNorms,
an MLP vmapped over the tokens) and an MLP without a sequence axis. Three jitted steps each,
`value and grad of the mean loss + an optax adam update`:

- `step`: `eqx.filter_value_and_grad` of the mean loss, no norms (the baseline);
- `norms`: `eqx_logs.value_grad_and_norms` (every parameter here is a Linear's or a
  LayerNorm's: all from the layers' inputs and output cotangents, no fallback);
- `vmap(grad)`: every example's gradient by `jax.vmap(jax.grad)`, their norms, and their mean
  for the update.

Timed in interleaved rounds (medians, and the median of the per-round ratios); memory from
`jax.jit(...).lower(...).compile().memory_analysis()` (temp + output bytes: the MLP step's
temp alone is a few bytes). Targets: `norms` within 1.3x the step's time and at most half of
`vmap(grad)`'s; memory within 1.2x the step's.
The three agree on the loss and update, and `norms` with `vmap(grad)` on the norms (checked).

Run: `python benchmarks/bench_per_example.py [--quick] [--batch 32 --tokens 128 --width 64
--mlp-batch 256 --mlp-width 512]`.
Exits 0 whatever the ratios.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))
import bench_core  # noqa: E402

import eqx_logs  # noqa: E402

TIME_TARGET = 1.3  # x the step without norms
VMAP_TARGET = 0.5  # x the step with vmap(grad) norms
MEMORY_TARGET = 1.2  # temp bytes, x the step without norms


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width: int, heads: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, 4 * width, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:  # (tokens, width)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


def loss_fn(block: Block, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((block(x) - y) ** 2)


def mlp_loss(mlp: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((mlp(x) - y) ** 2)


def make_steps(block: Any, loss_fn: Callable, optimiser: optax.GradientTransformation) -> dict:
    params, static = eqx.partition(block, eqx.is_inexact_array)

    def update(params, opt_state, grads):
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def mean_loss(params, x, y):
        model = eqx.combine(params, static)
        return jnp.mean(jax.vmap(lambda x, y: loss_fn(model, x, y))(x, y))

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mean_loss)(params, x, y)
        params, opt_state = update(params, opt_state, grads)
        return params, opt_state, loss, jnp.zeros(x.shape[0], jnp.float32)

    with_norms = eqx_logs.value_grad_and_norms(loss_fn)

    def norms(params, opt_state, x, y):
        loss, grads, n = with_norms(eqx.combine(params, static), x, y)
        params, opt_state = update(params, opt_state, grads)
        return params, opt_state, loss, n

    def per_example(params, opt_state, x, y):
        def one(x, y):
            return jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), x, y))(params)

        losses, grads = jax.vmap(one)(x, y)
        squares = sum(
            jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads)
        )
        mean_grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
        params, opt_state = update(params, opt_state, mean_grads)
        return params, opt_state, jnp.mean(losses), jnp.sqrt(squares)

    return {"step": step, "norms": norms, "vmap(grad)": per_example}


def bench_case(summary, label: str, model: Any, loss_fn: Callable, x, y, repeats: int) -> None:
    optimiser = optax.adam(1e-3)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optimiser.init(params)
    compiled, temp = {}, {}
    for name, fn in make_steps(model, loss_fn, optimiser).items():
        t0 = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(params, opt_state, x, y).compile()
        stats = compiled[name].memory_analysis()
        temp[name] = stats.temp_size_in_bytes + stats.output_size_in_bytes
        print(f"  compiled {name:10s} in {time.perf_counter() - t0:.1f} s")

    outs = {name: c(params, opt_state, x, y) for name, c in compiled.items()}
    for name in ("norms", "vmap(grad)"):  # the same work: the same update and loss
        np.testing.assert_allclose(outs[name][2], outs["step"][2], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(outs[name][0]), jax.tree.leaves(outs["step"][0])):
            # (adam's first step: lr * g / |g|, so 1e-3 where g is near 0 and rounds apart)
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(outs["norms"][3], outs["vmap(grad)"][3], rtol=1e-4)

    times = bench_core.interleaved(
        {
            name: (lambda c=c: jax.block_until_ready(c(params, opt_state, x, y)))
            for name, c in compiled.items()
        },
        repeats,
    )
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{label}: one training step, median of {repeats} interleaved rounds:")
    for name in compiled:
        print(
            f"  {name:10s} {bench_core.fmt_time(median[name]):>12s}   "
            f"temp + output {temp[name] / 2**20:8.2f} MiB"
        )
    vs_step = median["norms"] / median["step"]
    vs_vmap = median["norms"] / median["vmap(grad)"]
    paired_step = bench_core.paired_ratio(times["norms"], times["step"])
    paired_vmap = bench_core.paired_ratio(times["norms"], times["vmap(grad)"])
    memory = temp["norms"] / max(temp["step"], 1)
    memory_vmap = temp["vmap(grad)"] / max(temp["step"], 1)
    print(f"  norms / step        {vs_step:.3f}x (paired {paired_step:.3f}x)")
    print(f"  norms / vmap(grad)  {vs_vmap:.3f}x (paired {paired_vmap:.3f}x)")
    print(f"  memory: norms {memory:.3f}x the step's, vmap(grad) {memory_vmap:.3f}x\n")
    summary.add(
        f"{label}: time norms / step",
        f"{vs_step:.3f}x",
        f"<= {TIME_TARGET}x",
        vs_step <= TIME_TARGET,
    )
    summary.add(
        f"{label}: time norms / vmap(grad)",
        f"{vs_vmap:.3f}x",
        f"<= {VMAP_TARGET}x",
        vs_vmap <= VMAP_TARGET,
    )
    summary.add(
        f"{label}: memory norms / step",
        f"{memory:.3f}x",
        f"<= {MEMORY_TARGET}x",
        memory <= MEMORY_TARGET,
    )
    summary.add(f"{label}: memory vmap(grad) / step", f"{memory_vmap:.3f}x", "", None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp-batch", type=int, default=256)
    parser.add_argument("--mlp-width", type=int, default=512)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    started = time.perf_counter()
    summary = bench_core.Summary()
    repeats = 7 if args.quick else 21
    keys = jax.random.split(jax.random.key(0), 6)

    label = f"block B{args.batch} T{args.tokens} d{args.width}"
    print(f"{label}: a transformer block, {args.heads} heads, MLP 4x; adam")
    block = Block(args.width, args.heads, keys[0])
    shape = (args.batch, args.tokens, args.width)
    x = jax.random.normal(keys[1], shape, jnp.float32)
    y = jax.random.normal(keys[2], shape, jnp.float32)
    bench_case(summary, label, block, loss_fn, x, y, repeats)

    w = args.mlp_width
    label = f"MLP B{args.mlp_batch} {w}x{w}x{w}"
    print(f"{label}: no sequence axis, 2 hidden layers; adam")
    mlp = eqx.nn.MLP(w, w, w, 2, key=keys[3])
    x = jax.random.normal(keys[4], (args.mlp_batch, w), jnp.float32)
    y = jax.random.normal(keys[5], (args.mlp_batch, w), jnp.float32)
    bench_case(summary, label, mlp, mlp_loss, x, y, repeats)

    summary.print()
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
