"""Composing reductions in code, without Hydra: a window mean of the loss, several statistics
of the gradient norms at once, per-key rules, and a bounded stack for a while loop.

Run: `python examples/reductions.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np

import eqx_logs


def train(w, xs):
    """A toy linear regression trained by SGD; logs from inside the scanned step."""

    def step(w, x):
        y = 3.0 * x
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((w * x - y) ** 2))(w)
        eqx_logs.log({"loss": loss, "grad/w": jnp.abs(grad), "debug/x": x}, step=jnp.int32(0))
        return w - 0.002 * grad, None

    w, _ = jax.lax.scan(step, w, xs)

    def refine(w):  # a while loop: how many extra steps until the gradient is tiny
        def body(w):
            eqx_logs.log("refine/w", w)
            return w - 0.2 * (w - 3.0)

        return jax.lax.while_loop(lambda w: jnp.abs(w - 3.0) > 1e-3, body, w)

    return refine(w)


def main():
    xs = jax.random.normal(jax.random.key(0), (300, 8))
    policy = eqx_logs.Policy(
        reduce="mean",
        rules={
            "loss": eqx_logs.Window(100, "mean"),  # the mean loss of every 100 steps
            "grad/*": eqx_logs.Fanout(mean="mean", max="max", std=eqx_logs.Std()),
            "refine/*": eqx_logs.Stack(capacity=4, keep="last"),  # the last 4 of a while loop
            "debug/*": "drop",
        },
    )
    w, logs = jax.jit(eqx_logs.spool(train, policy=policy))(jnp.float32(0.0), xs)
    print(f"w = {float(w):.4f}")
    print(f"loss, mean per 100 steps: {np.asarray(logs['loss']).round(4)}")
    stats = {k: round(float(v), 4) for k, v in logs["grad/w"].items()}
    print(f"|grad w| over all steps: {stats}")
    print(f"refine: {int(logs.count['refine/w'])} steps, last 4: {np.asarray(logs['refine/w'])}")
    print(f"kept keys: {sorted(logs)}")
    assert "debug/x" not in logs


if __name__ == "__main__":
    main()
