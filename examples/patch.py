"""Activation patching: run a model on input A with one submodule's output taken from a run
on input B, and see how much of B's behaviour that one output carries.

    python examples/patch.py

The model is a small residual MLP (`embed`, three residual `blocks`, `head`), instrumented
with `eqx_logs.instrument`: nothing in it is edited. Two steps:

1. Read every submodule's output on B: `plant` each path with a function that logs its
   argument and returns it unchanged, inside a `spool` (a planted function may log).
2. Run A with one path planted with B's value (`plant(model, {path: value})`), and compute
   the loss against A's target. Planted at `embed` or `head`, the model's output is exactly
   B's (everything after them is computed from B's value): the check. Planted at a block,
   only that block's contribution to the residual stream is B's: the output is neither A's
   nor B's, and the loss says how much that block matters. A function planted instead of a
   value patches part of an output: here the first half of `blocks[1]`'s units.

Everything is computed in one jitted function (`patching`). The instrumented statistics of
a patched submodule are those of the planted value (printed for `blocks[1]`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_logs

WIDTH, DEPTH, SEED = 16, 3, 0
PATHS = ("embed", "blocks[0]", "blocks[1]", "blocks[2]", "head")
HALF = WIDTH // 2  # the units of blocks[1] patched by the function


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, h):
        return jnp.tanh(self.linear(h))


class ResidualMLP(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list[Block]
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, DEPTH + 2)
        self.embed = eqx.nn.Linear(4, WIDTH, key=keys[0])
        self.blocks = [Block(eqx.nn.Linear(WIDTH, WIDTH, key=k)) for k in keys[1:-1]]
        self.head = eqx.nn.Linear(WIDTH, 2, key=keys[-1])

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


@eqx.filter_jit
def setup():
    """The model and the two inputs, A's target."""
    key_model, key_a, key_b, key_y = jax.random.split(jax.random.key(SEED), 4)
    model = ResidualMLP(key_model)
    x_a = jax.random.normal(key_a, (4,))
    x_b = jax.random.normal(key_b, (4,))
    y_a = jax.random.normal(key_y, (2,))
    return model, x_a, x_b, y_a


def recorder(path):
    """A function to plant at `path`: logs the output there under `on_b/<path>`, unchanged."""

    def record(h):
        eqx_logs.log(f"on_b/{path}", h)
        return h

    return record


@eqx.filter_jit
def patching(imodel, x_a, x_b, y_a):
    """Every number the example prints, computed in one program."""

    def loss(out):
        return jnp.mean((out - y_a) ** 2)

    # 1. every instrumented output on B (and the statistics of A and B)
    reading = eqx_logs.plant(imodel, {p: recorder(p) for p in PATHS})
    out_b, logs_b = eqx_logs.spool(reading)(x_b)
    on_b = {p: logs_b[f"on_b/{p}"][0] for p in PATHS}  # (one event each)
    out_a, logs_a = eqx_logs.spool(imodel)(x_a)

    # 2. A, each path patched with B's output there; and half of blocks[1]'s units
    def half(h):
        return h.at[:HALF].set(on_b["blocks[1]"][:HALF])

    losses = {"A": loss(out_a), "B": loss(out_b)}
    reproduces = {}
    for p in PATHS:
        out = eqx_logs.plant(imodel, {p: on_b[p]})(x_a)
        losses[p] = loss(out)
        reproduces[p] = jnp.allclose(out, out_b, rtol=1e-5, atol=1e-6)
    losses["half"] = loss(eqx_logs.plant(imodel, {"blocks[1]": half})(x_a))
    patched = eqx_logs.plant(imodel, {"blocks[1]": on_b["blocks[1]"]})
    _, logs = eqx_logs.spool(patched)(x_a)
    rms = [logs_a["blocks[1]/rms"][0], logs_b["blocks[1]/rms"][0], logs["blocks[1]/rms"][0]]
    return losses, reproduces, rms


def main():
    model, x_a, x_b, y_a = setup()
    imodel = eqx_logs.instrument(model, stats=("rms",), where=PATHS)
    losses, reproduces, rms = patching(imodel, x_a, x_b, y_a)

    print(f"loss on A: {float(losses['A']):.6f}")
    print(f"loss of B's output against A's target: {float(losses['B']):.6f}")
    for p in PATHS:
        print(f"A with {p} patched from B: {float(losses[p]):.6f}")
    print(f"A with half of blocks[1] patched from B: {float(losses['half']):.6f}")
    for p in ("embed", "head"):
        print(f"patching {p} reproduces B's output: {bool(reproduces[p])}")
    a, b, patched = (float(r) for r in rms)
    print(f"rms of blocks[1]'s output: A {a:.6f}, B {b:.6f}, patched {patched:.6f}")


if __name__ == "__main__":
    main()
