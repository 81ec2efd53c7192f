"""Find the layer that blows up: `eqx_logs.instrument` and `spool(first_nonfinite=True)`.

    python examples/instrument.py

A small leaky-ReLU MLP whose layers[1] is initialised 4x too large is trained by SGD, the
steps scanned inside `eqx.filter_jit`, with a learning rate that warms up to a value too large
for it. For about 20 steps the loss falls; then, as the learning rate keeps rising, it climbs,
and from step 26 the weights explode: every layer's output and gradient grows by orders of
magnitude each step, until one of them overflows to inf and everything computed from it is
inf or NaN. Which one was first?

`eqx_logs.instrument(model, stats=..., grads=True)` logs statistics of every layer's output,
and of its cotangent in the backward pass, without editing the model; `first_nonfinite=True`
makes the spool also report the first logged value, in execution order, with a NaN or an
infinite element: its key (so the layer), its step (the scan's iteration), its pass and where
it was logged. The example prints that report and a table of every layer's statistics over
the steps before it. With these seeds it names the badly initialised layer: the gradient
flowing into layers[1] overflows first, in the backward pass of step 28, while every layer's
output is still finite (the loss overflows in that step too, but is logged after the backward
pass).

The statistics shown are absmax (the largest |value|) and nonfinite (how many elements are NaN
or infinite). Any statistic would do for the report: those built on sums (mean, std, rms,
norm) are computed on `x / absmax` where squares would overflow, so a finite array has finite
statistics and an event is non-finite exactly when the layer's output (or cotangent) is.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_logs

SIZES = (4, 32, 32, 32, 1)  # input, three hidden layers, output
BAD_LAYER, BAD_SCALE = 1, 4.0  # layers[1]'s weights are initialised BAD_SCALE times too large
PEAK_LR, WARMUP = 2.0, 40  # the learning rate rises linearly to PEAK_LR over WARMUP steps
STEPS, BATCH, SEED = 60, 64, 1
STATS = ("absmax", "nonfinite")
SHOW = 4  # steps shown before the blow-up


class Dense(eqx.Module):
    """A linear layer applied to a batch, `(batch, in) -> (batch, out)`: the statistics
    `instrument` logs for it are over the whole batch."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, n_in: int, n_out: int, *, key: jax.Array, scale: float = 1.0):
        linear = eqx.nn.Linear(n_in, n_out, key=key)  # its initialisation
        self.weight = scale * linear.weight
        self.bias = linear.bias

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight.T + self.bias[None, :]  # no implicit rank promotion


class MLP(eqx.Module):
    layers: tuple[Dense, ...]

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, len(SIZES) - 1)
        self.layers = tuple(
            Dense(n_in, n_out, key=k, scale=BAD_SCALE if i == BAD_LAYER else 1.0)
            for i, (n_in, n_out, k) in enumerate(zip(SIZES[:-1], SIZES[1:], keys))
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.leaky_relu(layer(x))
        return self.layers[-1](x)[:, 0]


def dataset(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(key, (BATCH, SIZES[0]))
    return x, jnp.sin(2 * x[:, 0]) * jnp.cos(x[:, 1])


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def learning_rate(i: jax.Array) -> jax.Array:
    return PEAK_LR * jnp.minimum(1.0, (i + 1) / WARMUP)


@eqx.filter_jit  # one compiled program, not one per operation of the initialisation
def setup() -> tuple[MLP, jax.Array, jax.Array]:
    """The model (not instrumented) and the data."""
    kdata, kmodel = jax.random.split(jax.random.key(SEED))
    x, y = dataset(kdata)
    return MLP(kmodel), x, y


@eqx.filter_jit
def train(model, x, y):
    """`STEPS` SGD steps, scanned and spooled; returns the model and the logs."""
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, i):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(eqx.combine(params, static), x, y)
        eqx_logs.log({"loss": loss}, step=i)
        params = jax.tree.map(lambda p, g: p - learning_rate(i) * g, params, grads)
        return params, None

    def run(params):
        return jax.lax.scan(step, params, jnp.arange(STEPS))[0]

    # every event stacked; `first_nonfinite` also finds the first NaN or inf among them
    params, logs = eqx_logs.spool(run, reduce="stack", first_nonfinite=True)(params)
    return eqx.combine(params, static), logs


def layer_of(key: str) -> tuple[str, bool]:
    """`("layers[2]", True)` for `"layers[2]/grad/absmax"`: the layer, and whether the key is
    a statistic of its cotangent."""
    path = key.rsplit("/", 1)[0]
    return path.removesuffix("/grad"), path.endswith("/grad")


def main() -> None:
    model, x, y = setup()
    model = eqx_logs.instrument(model, stats=STATS, grads=True)
    _, logs = train(model, x, y)

    event = logs.first_nonfinite
    if event is None:
        print(f"every logged value is finite after {STEPS} steps")
        return
    print(event)
    # `instrument` logs no step value; the scan's iteration is the step (the loss has both)
    step = event.steps.get("step", event.iterations[0])
    layer, backward = layer_of(event.key)
    what = "gradient (backward pass)" if backward else "output (forward pass)"
    print(f"first non-finite: {layer} {what} at step {step}, key {event.key!r}")
    path = event.key.rsplit("/", 1)[0]
    if f"{path}/nonfinite" in logs:
        count = int(logs[f"{path}/nonfinite"][step])
        size = BATCH * SIZES[int(layer.removeprefix("layers[").removesuffix("]")) + 1]
        print(f"{count} of its {size} values are inf or NaN")
    loss = np.asarray(logs["loss"])
    print(f"loss: {loss[0]:.4g} at step 0, {loss[step - 1]:.4g} at step {step - 1}", end="")
    print(f", {loss[step]:.4g} at step {step}")

    # absmax of every layer's output and cotangent, in execution order, the steps before
    names = [f"layers[{i}]" for i in range(len(SIZES) - 1)]
    rows = names + [f"{n}/grad" for n in reversed(names)]
    steps = list(range(max(0, step - SHOW), step + 1))
    print(f"absmax of each layer's output, then of its gradient, steps {steps[0]} to {step}:")
    print(f"{'':14}" + "".join(f"{f'step {s}':>12}" for s in steps))
    for row in rows:
        values = np.asarray(logs[f"{row}/absmax"])
        flag = "  <- first non-finite" if f"{row}/absmax" == event.key else ""
        print(f"{row:14}" + "".join(f"{values[s]:12.3g}" for s in steps) + flag)


if __name__ == "__main__":
    main()
