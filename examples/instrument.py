"""Find the layer that blows up: `eqx_logs.instrument` and `spool(first_nonfinite=True)`.

    python examples/instrument.py

A small ReLU MLP whose layers[1] is initialised 4x too large is trained by SGD, the steps
scanned inside `eqx.filter_jit`, with a learning rate that warms up to a value too large for
it. After a while the weights start to grow, and a few steps later some layer's output (or
the gradient flowing into it) overflows to inf or NaN, and everything after it goes NaN.

`eqx_logs.instrument(model, stats=..., grads=True)` logs statistics of every layer's output,
and of its cotangent in the backward pass, without editing the model; `first_nonfinite=True`
makes the spool also report the first event, in execution order, with a NaN or infinite
value: which key (so which layer), which step, which pass, and where it was logged. The
example prints that report and the statistics of every layer over the steps before it.

The statistics are absmax (the largest |value|) and nonfinite (how many elements are NaN or
infinite): both are exact for any finite array, so an event is non-finite exactly when the
layer's output (or cotangent) is. (rms, std, norm and mean of a finite array can overflow
float32 on their own, from about 1e19: the report would name that statistic's layer before
any value is infinite.)
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_logs

SIZES = (4, 32, 32, 32, 1)  # input, three hidden layers, output
BAD_LAYER, BAD_SCALE = 1, 4.0  # layers[1]'s weights are initialised BAD_SCALE times too large
PEAK_LR, WARMUP = 0.5, 40  # the learning rate rises linearly to PEAK_LR over WARMUP steps
STEPS, BATCH, SEED = 60, 64, 0
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
        return x @ self.weight.T + self.bias


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
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)[:, 0]


def dataset(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(key, (BATCH, SIZES[0]))
    return x, jnp.sin(2 * x[:, 0]) * jnp.cos(x[:, 1])


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def learning_rate(i: jax.Array) -> jax.Array:
    return PEAK_LR * jnp.minimum(1.0, (i + 1) / WARMUP)


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
    """`("layers[2]", True)` for `"layers[2]/grad/absmax"`: the layer, and whether it is the
    statistic of its cotangent."""
    path = key.rsplit("/", 1)[0]
    return path.removesuffix("/grad"), path.endswith("/grad")


def step_of(event: eqx_logs.NonfiniteEvent) -> int:
    # `instrument` logs no step value: each layer runs once a step, forward and backward, so
    # the index of its event is the step (the loss is logged with `step=i`)
    return event.steps.get("step", event.event)


def main() -> None:
    model, x, y = setup()
    model = eqx_logs.instrument(model, stats=STATS, grads=True)
    _, logs = train(model, x, y)
    losses = np.asarray(logs["loss"])
    print(f"loss {losses[0]:.4f} at step 0, {losses[WARMUP // 2]:.4f} at step {WARMUP // 2}")

    event = logs.first_nonfinite
    if event is None:
        print(f"every logged value is finite after {STEPS} steps")
        return
    step = step_of(event)
    layer, backward = layer_of(event.key)
    print(event)
    print(
        f"first non-finite: {layer} {'gradient (backward' if backward else 'output (forward'} "
        f"pass) at step {step}, key {event.key!r}"
    )

    # absmax of every layer's output (forward) and cotangent (backward), the steps before
    names = [f"layers[{i}]" for i in range(len(SIZES) - 1)]
    rows = [n for n in names] + [f"{n}/grad" for n in reversed(names)]  # execution order
    steps = list(range(max(0, step - SHOW), step + 1))
    print(f"absmax per layer, steps {steps[0]}..{step} (forward, then backward):")
    print(f"{'':14}" + "".join(f"{f'step {s}':>12}" for s in steps))
    for row in rows:
        values = np.asarray(logs[f"{row}/absmax"])
        flag = "  <- first non-finite" if row == event.key.rsplit("/", 1)[0] else ""
        print(f"{row:14}" + "".join(f"{values[s]:12.3g}" for s in steps) + flag)


if __name__ == "__main__":
    main()
