"""Finding mislabelled examples from per-example statistics, reduced on the device: a small
classifier trained on scikit-learn's digits (shipped with scikit-learn: nothing downloaded),
with the labels of a few known examples flipped. Each epoch is one jitted scan over the
batches, spooled into a JSONL file; in it, every batch logs

- its per-example losses with their ids in the dataset, reduced by `TopK(16)`: the epoch's 16
  highest losses and which examples they were;
- its per-example gradient norms (`value_grad_and_norms`, without per-example gradients),
  with `TopK(16)` too;
- the quantiles of its losses (`Quantiles`: p10, p50, p90, p99 of the epoch's losses);
- the gradient noise scale (`log_noise_scale`, from the norms and the batch gradient).

At the end it prints the last epoch's top ids, marking the flipped ones, and how many of
them the top-k named.

Run: `.venv/bin/python examples/mislabelled.py [directory]` (after `make demo`); it writes
`<directory>/mislabelled.jsonl` (a temporary directory by default), which
`python -m eqx_logs plot <directory>` draws (the loss quantiles as a band).
"""

import os
import sys
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import eqx_logs
from eqx_logs.loggers import JsonlLogger, read_jsonl

FLIPPED = 8  # examples whose label is changed to another class
TRAIN = 1500  # training examples (the other 297 digits test the classifier)
BATCH = 100
EPOCHS = 20
K = 16  # the top-k kept per epoch


def dataset(seed: int = 0):
    """The digits scaled to [0, 1], split into training and test examples; the labels of
    `FLIPPED` training examples (`flipped`, their ids: their rows in `x_train`) changed to
    another class, drawn at random."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:TRAIN], y[:TRAIN].copy(), x[TRAIN:], y[TRAIN:]
    flipped = np.sort(rng.choice(TRAIN, FLIPPED, replace=False))
    y_train[flipped] = (y_train[flipped] + rng.integers(1, 10, FLIPPED)) % 10
    return x_train, y_train, x_test, y_test, flipped


def example_loss(model, x, y):
    """One example's cross-entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y)


@eqx.filter_jit
def epoch(model, opt_state, logger, state, x, y, order, e, *, optimizer):
    """One epoch: a scan over the batches of `order` (the example ids, `(batches, BATCH)`),
    its logs spooled to `logger`'s run `state`, reduced over the epoch's batches."""

    params, static = eqx.partition(model, eqx.is_array)  # the scan carries arrays only

    def step(carry, ids):
        params, opt_state = carry
        model = eqx.combine(params, static)
        xb, yb = x[ids], y[ids]
        # the batch's mean loss, its gradient, and each example's gradient norm
        loss, grads, norms = eqx_logs.value_grad_and_norms(example_loss)(model, xb, yb)
        losses = jax.vmap(example_loss, in_axes=(None, 0, 0))(model, xb, yb)
        eqx_logs.log("loss/example", losses, ids=ids, reduce=eqx_logs.TopK(K), step=e)
        eqx_logs.log("grad_norm/example", norms, ids=ids, reduce=eqx_logs.TopK(K), step=e)
        quantiles = eqx_logs.Quantiles(q=(0.1, 0.5, 0.9, 0.99))
        eqx_logs.log("loss", losses, reduce=quantiles, step=e)
        eqx_logs.log_noise_scale("noise_scale", norms, grads, step=e)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return (eqx.apply_updates(params, updates), opt_state), loss

    def run(params, opt_state):
        return jax.lax.scan(step, (params, opt_state), order)[0]

    params, opt_state = logger.spool(run, state)(params, opt_state)
    return eqx.combine(params, static), opt_state


def main(directory: str, epochs: int = EPOCHS, seed: int = 0):
    """Train, writing `<directory>/mislabelled.jsonl`; returns the model, the file's path and
    the flipped examples' ids."""
    x, y, x_test, y_test, flipped = dataset(seed)
    kmodel, kperm = jax.random.split(jax.random.key(seed))
    model = eqx.nn.MLP(64, 10, 64, 1, key=kmodel)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    path = os.path.join(directory, "mislabelled.jsonl")
    with JsonlLogger(path) as logger:
        state = logger.init()
        for e in range(epochs):
            order = jax.random.permutation(jax.random.fold_in(kperm, e), TRAIN)
            order = order.reshape(TRAIN // BATCH, BATCH).astype(jnp.int32)
            model, opt_state = epoch(
                model, opt_state, logger, state, x, y, order, np.int32(e), optimizer=optimizer
            )
    accuracy = float(jnp.mean(jnp.argmax(jax.vmap(model)(x_test), axis=-1) == y_test))
    # the last epoch's records: each key's one record of the epoch's spool
    last = {r["key"]: r["value"] for r in read_jsonl(path) if r["step"] == epochs - 1}
    print(f"wrote {path}: {epochs} epochs, test accuracy {accuracy:.3f}")
    print(f"flipped labels: ids {flipped.tolist()}")
    for key in ("loss/example", "grad_norm/example"):
        ids = last[key]["id"]  # best first
        found = set(ids) & set(flipped.tolist())
        marked = " ".join(f"{i}*" if i in found else str(i) for i in ids)
        print(f"{key}, top {K} of epoch {epochs - 1}: {marked}")
        print(f"  {len(found)} of the {FLIPPED} flipped examples named (*)")
    quantiles = ", ".join(f"{name} {v:.3g}" for name, v in last["loss"].items())
    print(f"loss quantiles of epoch {epochs - 1}: {quantiles}")
    b_simple = last["noise_scale"]["b_simple"]
    print(f"noise scale B_simple: {b_simple:.3g} examples (the batch: {BATCH})")
    return model, path, flipped


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
