"""The training loop most scripts write: one compiled step per Python iteration, its logs
written to a file by `logger.jit`, without a host callback in the step.

Run: `.venv/bin/python examples/step_loop.py [directory]` (after `make demo` has made
`.venv`); it writes `<directory>/run.jsonl` (a temporary directory by default) and prints
what it wrote.
"""

import os
import sys
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_logs
from eqx_logs.loggers import JsonlLogger, read_jsonl

STEPS, INTERVAL = 1000, 100


def train_step(model, opt_state, x, y, step, *, optimizer):
    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    # kept every INTERVAL steps; the other steps run without their logs (their grad norm is
    # never computed: it is only logged), picked on the host from the step (`step="step"`)
    eqx_logs.log({"loss": loss, "grad_norm": optax.tree.norm(grads)}, step=step)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state


def setup():
    """The data, the model, the optimizer and its state."""
    kx, km = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 2))
    y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:])
    model = eqx.nn.MLP(2, 1, 32, 2, key=km)
    optimizer = optax.sgd(0.1)
    return x, y, model, optimizer, optimizer.init(eqx.filter(model, eqx.is_array))


def main(directory: str) -> None:
    x, y, model, optimizer, opt_state = setup()
    path = os.path.join(directory, "run.jsonl")
    with JsonlLogger(path) as logger:  # leaving the block writes what is left and closes
        step = logger.jit(train_step, logger.init(), interval=INTERVAL, step="step")
        for i in range(STEPS):
            # the step named: its Python int is passed traced (one compiled step for every i)
            model, opt_state = step(model, opt_state, x, y, i, optimizer=optimizer)
    rows = [r for r in read_jsonl(path) if r["key"] == "loss"]
    print(f"wrote {path}: {len(rows)} losses, steps {rows[0]['step']}..{rows[-1]['step']}")
    print(f"loss: {rows[0]['value']:.4f} -> {rows[-1]['value']:.4f}")
    assert rows[-1]["value"] < rows[0]["value"], "training should reduce the loss"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
