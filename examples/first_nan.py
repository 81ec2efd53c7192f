"""Find the first NaN of a training run that diverges, in code you did not instrument:
`eqx_logs.spool(..., first_nonfinite="any")`.

    python examples/first_nan.py

An Equinox MLP classifier is trained by SGD (optax), the steps scanned inside
`eqx.filter_jit`, with a learning rate too large for it: the logits grow step after step.
The loss is written the naive way, `-log(softmax(logits)[label])`. Once a logit of a wrong
class exceeds the right one by more than about 104, `softmax` rounds that probability to
exactly 0 in float32, `log` makes it `-inf`, and from then on the loss is `inf` and every
gradient NaN.

No `log` call is in the model or the loss. `first_nonfinite="any"` checks the output of
every operation that can make a NaN or an infinity out of finite values (divisions, `exp`,
`log`, matmuls, sums, ... forward and backward, in optax's code too), on the device, in the
same run, and reports the first: the operation, its address in the program, the line of
this file that led to it, and the scan's iteration, that is the training step. The fix it
points to: `jax.nn.log_softmax`, which never rounds to `log(0)`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_logs

STEPS, BATCH, CLASSES, LR, SEED = 20, 64, 4, 10.0, 0


def naive_loss(model, x, labels):
    probs = jax.nn.softmax(jax.vmap(model)(x))
    picked = jnp.take_along_axis(probs, labels[:, None], axis=1)
    return -jnp.mean(jnp.log(picked))  # log(0) = -inf once a probability rounds to 0


def stable_loss(model, x, labels):
    logp = jax.nn.log_softmax(jax.vmap(model)(x))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def data(key):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (BATCH, 8))
    labels = jnp.argmax(x @ jax.random.normal(kw, (8, CLASSES)), axis=1)
    return x, labels


def train(model, x, labels, loss_fn=naive_loss):
    """`STEPS` steps of SGD, scanned; returns the final model and each step's loss."""
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.sgd(LR)

    def step(carry, _):
        params, state = carry
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), x, labels))(
            params
        )
        updates, state = optimizer.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), loss

    (params, _), losses = jax.lax.scan(step, (params, optimizer.init(params)), length=STEPS)
    return eqx.combine(params, static), losses


def main():
    key = jax.random.key(SEED)
    model = eqx.nn.MLP(8, CLASSES, 64, 2, key=key)
    x, labels = data(jax.random.fold_in(key, 1))
    search = eqx.filter_jit(eqx_logs.spool(train, first_nonfinite="any"))
    (_, losses), logs = search(model, x, labels)
    report = logs.first_nonfinite
    first_inf = int(jnp.argmax(~jnp.isfinite(losses)))
    print(
        f"losses: step 0 {float(losses[0]):.3f}, step {first_inf - 1} "
        f"{float(losses[first_inf - 1]):.3f}, step {first_inf} {float(losses[first_inf])}"
    )
    print(report)
    (_, stable), _ = eqx.filter_jit(eqx_logs.spool(train))(model, x, labels, stable_loss)
    print(f"with log_softmax, step {first_inf}: {float(stable[first_inf]):.3f} (finite)")
    return report, losses, stable


if __name__ == "__main__":
    main()
