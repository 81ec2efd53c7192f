"""`log_noise_scale`: the gradient noise scale's event (`NoiseScale`) from per-example (or
per-micro-batch) gradient norms and the batch gradient."""

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Float, PyTree

from ._log import log
from ._reduce._noise_scale import NoiseScale, check_sizes
from ._reduce._reductions import _float_dtype
from ._scope import call_site


def _real(dtype: Any) -> np.dtype:
    """The real dtype a squared norm of `dtype` is taken in: Mean's (never narrower than
    float32), real for complex dtypes."""
    dtype = _float_dtype(dtype)
    return np.dtype(jnp.finfo(dtype).dtype) if jnp.issubdtype(dtype, jnp.complexfloating) else dtype


def _squared_norm(x: Array, dtype: Any) -> Array:
    x = x.astype(_float_dtype(x.dtype))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        square = jnp.real(x) ** 2 + jnp.imag(x) ** 2
    else:
        square = x * x
    return jnp.sum(square).astype(dtype)


def log_noise_scale(
    name: str,
    norms: Float[ArrayLike, " batch"],
    grads: PyTree[ArrayLike],
    *,
    b_small: int | ArrayLike = 1,
    b_big: int | ArrayLike | None = None,
    axis_name: Hashable | None = None,
    reduce: Any = None,
    tags: str | tuple[str, ...] = (),
    **steps: int | ArrayLike,
) -> None:
    """Log the gradient noise scale's terms at one step, for
    [`NoiseScale`][eqx_logs.NoiseScale] (McCandlish et al. 2018, appendix A), from the norms
    of per-example gradients and the batch gradient: `small = mean_i norms_i^2` (at
    `b_small = 1`) and `big = ||grads||^2` (at `b_big`, the batch size). A spool then gives
    `logs[name] == {"b_simple": ..., "trace": ..., "grad_sq": ...}`.

    **Arguments:**

    - `name`: the key (scopes apply, as for `log`).
    - `norms`: `(batch,)`, the norm of each example's gradient, `||grad l_i||` (as
        `eqx_logs.value_grad_and_norms` gives). Micro-batches: the norm of each micro-batch's
        gradient (of its mean loss), with `b_small` the micro-batch size.
    - `grads`: the gradient of the mean loss over the batch, a pytree; its leaves that are
        inexact arrays count (others, as Equinox's static parts, are ignored).
    - `b_small`: the number of examples behind each norm: 1 (the default) for per-example
        gradients, the micro-batch size for micro-batch gradients.
    - `b_big`: the number of examples behind `grads`; by default `b_small * batch`.
    - `axis_name`: for data parallelism (a `shard_map`'s, `pmap`'s or named `vmap`'s axis,
        or a tuple of them) where `norms` and `grads` are this device's: `small` and `big`
        are averaged over the devices (two scalars, one `pmean`) before they are logged, so
        every device logs the same event, that of the devices' terms averaged per step. If
        `grads` is already the mean over the devices (after the data-parallel `pmean`), pass
        `b_big` = the global batch (the devices' examples together): `big` then is that
        batch's squared norm. Otherwise `b_big` is the device's batch.
    - `reduce`: the reduction of the key; `NoiseScale()` (decay 0.99) by default.
    - `tags`, `**steps`: as for [`eqx_logs.log`][].

    **Returns:**

    None. Outside any `spool` or `tap` this logs nothing (the norms are still computed
    where they are needed, which XLA removes as unused under `jit`).

    Batch sizes known when tracing (Python ints) with `b_small >= b_big` raise a `ValueError`
    naming the key; sizes known only on the device make NaN of the averages (see
    `NoiseScale`).

    !!! example

        ```python
        def loss(w, x, y):
            return (w * x - y) ** 2

        def step(w, k):
            x = jax.random.normal(k, (32,))
            y = 2.0 * x + 0.5 * jax.random.normal(jax.random.fold_in(k, 1), (32,))
            per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(w, x, y)
            g = jnp.mean(per_example)
            eqx_logs.log_noise_scale("noise", jnp.abs(per_example), g)
            return w - 0.1 * g, None

        keys = jax.random.split(jax.random.key(0), 20)
        _, logs = eqx_logs.spool(lambda: jax.lax.scan(step, 0.0, keys))()
        print(logs["noise"]["b_simple"])
        ```
    """
    site = call_site()
    where = f"eqx_logs.log_noise_scale({name!r}) at {site}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"{where}: the name must be a non-empty string, got {name!r}.")
    try:
        norms = jnp.asarray(norms)
    except TypeError as e:
        raise TypeError(
            f"{where}: norms must be an array of per-example gradient norms, shape (batch,); "
            f"got {type(norms).__name__}."
        ) from e
    if norms.ndim != 1 or norms.shape[0] == 0:
        raise ValueError(
            f"{where}: norms must have shape (batch,) with batch >= 1, one gradient norm per "
            f"example (or per micro-batch), got shape {norms.shape}. Under vmap, each lane's "
            "norms are its own (batch,)."
        )
    if not jnp.issubdtype(norms.dtype, jnp.floating):
        raise TypeError(
            f"{where}: norms must be real floating-point norms, got dtype {norms.dtype}."
        )
    leaves = jtu.tree_leaves(eqx.filter(grads, eqx.is_inexact_array))
    if not leaves:
        raise ValueError(
            f"{where}: grads has no inexact array leaves: it must be the batch gradient "
            f"(the gradient of the mean loss), a pytree of arrays; got {type(grads).__name__}."
        )
    if b_big is None:
        b_big = b_small * norms.shape[0]
    check_sizes(b_small, b_big, where)
    dtypes = [_real(norms.dtype), *(_real(x.dtype) for x in leaves)]
    dtype = np.result_type(*dtypes)  # float32 or float64 (half dtypes were widened)
    norms = norms.astype(dtype)
    small = jnp.mean(norms * norms)
    big = sum((_squared_norm(x, dtype) for x in leaves[1:]), start=_squared_norm(leaves[0], dtype))
    if axis_name is not None:
        small, big = lax.pmean((small, big), axis_name)
    event = {"small": small, "big": big, "b_small": b_small, "b_big": b_big}
    reduce = NoiseScale() if reduce is None else reduce
    log(name, event, reduce=reduce, tags=tags, **steps)
