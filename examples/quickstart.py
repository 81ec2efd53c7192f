"""Train a small Equinox MLP with the steps scanned inside `eqx.filter_jit`, logging from
inside the model, the loss and the gradients, and read everything back from `spool`.

Run: `.venv/bin/python examples/quickstart.py` (after `make demo` has made `.venv`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_logs


class MLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(2, 32, key=k1), eqx.nn.Linear(32, 1, key=k2)]

    def __call__(self, x):
        h = jax.nn.tanh(self.layers[0](x))
        with eqx_logs.scope("hidden"):
            eqx_logs.log("mean_abs", jnp.mean(jnp.abs(h)), tags="debug")
        return self.layers[1](h)[0]


def loss_fn(model, x, y):
    pred = jax.vmap(model)(x)
    pred = eqx_logs.log_grad("dpred", pred)  # logs d loss / d pred in the backward pass
    return jnp.mean((pred - y) ** 2)


@eqx.filter_jit
@eqx_logs.spool(exclude="debug")
def train(model, x, y, lr, num_steps):
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, i):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), x, y))(params)
        grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        eqx_logs.log({"loss": loss, "grad_norm": grad_norm}, step=i)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return params, None

    params, _ = jax.lax.scan(step, params, jnp.arange(num_steps))
    return eqx.combine(params, static)


def main():
    kx, km = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 2))
    y = jnp.sin(x[:, 0]) * jnp.cos(x[:, 1])
    model, logs = train(MLP(km), x, y, 0.3, 500)
    loss = np.asarray(logs["loss"])
    print(f"logged keys: {sorted(logs)}")
    print(
        f"loss: {loss.shape[0]} events, step {int(logs.step['loss'][0])}..."
        f"{int(logs.step['loss'][-1])}: {loss[0]:.4f} -> {loss[-1]:.4f}"
    )
    print(f"grad_norm at the last step: {float(logs['grad_norm'][-1]):.4f}")
    print(f"dpred: {logs['dpred'].shape} (one backward event per step, batch of 64)")
    assert loss[-1] < loss[0], "training should reduce the loss"


if __name__ == "__main__":
    main()
