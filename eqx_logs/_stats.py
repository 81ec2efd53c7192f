"""Statistics of arrays, reduced on device: `log_stats`, and what `instrument` logs."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, PyTree

from . import _compat
from ._primitive import _call_site, _check_step, _normalise_tags, bind, current_prefix


def _float_dtype(dtype: Any) -> Any:
    # statistics in at least float32: a bfloat16 activation's mean of squares overflows
    if not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.dtype(jnp.float32)
    return jnp.promote_types(dtype, jnp.float32)


def _float(x: Array) -> Array:
    return x.astype(_float_dtype(x.dtype))


# The statistics, each a scalar over all of an array; `nonfinite` counts its NaN and infinite
# elements.
STATS = ("mean", "std", "rms", "absmax", "min", "max", "norm", "nonfinite")


def _compute(x: Array, *, stats: tuple[str, ...]) -> list[Array]:
    """The statistics `stats` of all of `x`, in at least float32, in as few passes over `x`
    as a CPU makes (it runs each reduction as a loop of its own, and writes out an
    elementwise array that two reductions share):

    - the common case takes `max |x|`, `sum x` and `sum x**2`: reductions of `x` itself, each
      with its elementwise operation fused in, so nothing the size of `x` is written;
    - one `lax.cond` goes to a careful path where those cannot serve: `x` has a NaN or an
      infinity (then `nonfinite` counts them, and the other statistics are not finite), the
      sums overflow (values past about 1e16) or the squares underflow (below about 1e-19),
      or the mean dwarfs the spread (the variance from the two sums would cancel). It scales
      `x` by a power of two (exactly) and takes the variance around the mean. So a finite
      array has finite statistics, and `first_nonfinite` finds the value, not its statistic.
    """
    need = set(stats)
    inexact = jnp.issubdtype(x.dtype, jnp.inexact)
    x = _float(x)
    n = x.size
    absmax = jnp.max(jnp.abs(x))
    zero = jnp.zeros((), x.dtype)
    out: dict[str, Array] = {"absmax": absmax}
    if need & {"mean", "std", "rms", "norm", "nonfinite"}:
        total = jnp.sum(x) if need & {"mean", "std"} else zero
        squares = jnp.sum(jnp.square(x)) if need & {"std", "rms", "norm"} else zero
        mean, square = total / n, squares / n
        var = jnp.maximum(square - mean * mean, 0)
        ok = jnp.isfinite(absmax) & jnp.isfinite(total) & jnp.isfinite(squares)
        if need & {"std", "rms", "norm"}:  # squares of tiny values lose their digits
            ok = ok & ((square >= jnp.finfo(x.dtype).tiny) | (absmax == 0))
        if "std" in need:
            ok = ok & (var >= 1e-3 * square)  # else the one-pass variance cancels

        def quick():
            return mean, jnp.sqrt(var), jnp.sqrt(square), jnp.zeros((), jnp.int32)

        def careful():
            finite = jnp.isfinite(absmax)
            # 2**-e with `absmax < 2**e`, between 2**-126 and 2**126: exact, no subnormals
            e = jnp.frexp(jnp.where(finite & (absmax > 0), absmax, 1))[1]
            scale = jnp.ldexp(jnp.ones_like(absmax), -jnp.clip(e, -126, 126))
            y = x * scale
            m = jnp.sum(y) / n
            d = y - m
            # around the computed mean, corrected for its rounding error
            var = jnp.maximum(jnp.sum(jnp.square(d)) / n - jnp.square(jnp.sum(d) / n), 0)
            count = jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) if inexact else 0
            nonfinite = jnp.where(finite, 0, count).astype(jnp.int32)
            rms = jnp.sqrt(var + jnp.square(m)) / scale
            return m / scale, jnp.sqrt(var) / scale, rms, nonfinite

        mean, std, rms, nonfinite = lax.cond(ok, quick, careful)
        out.update(mean=mean, std=std, rms=rms, norm=rms * np.sqrt(n), nonfinite=nonfinite)
    if "min" in need:
        out["min"] = jnp.min(x)
    if "max" in need:
        out["max"] = jnp.max(x)
    return [out[name] for name in stats]


DEFAULT_STATS = ("mean", "std", "rms", "absmax", "nonfinite")


def check_stats(stats: Any, where: str) -> tuple[str, ...]:
    """`stats` as a tuple of known statistic names; `where` names the caller in errors."""
    if isinstance(stats, str):
        stats = (stats,)
    if not isinstance(stats, Sequence) or not stats:
        raise TypeError(
            f"{where}: stats must be a non-empty tuple of statistic names from {tuple(STATS)}, "
            f"got {stats!r}."
        )
    unknown = [s for s in stats if s not in STATS]
    if unknown:
        raise ValueError(f"{where}: unknown statistic(s) {unknown!r}; choose from {tuple(STATS)}.")
    return tuple(dict.fromkeys(stats))


def path_name(path: Sequence[Any]) -> str:
    """A pytree path as `jax.tree_util.keystr` writes it, without the leading dot:
    `layers[0].weight`, `['w']`."""
    return jtu.keystr(tuple(path)).removeprefix(".")


# The statistics of one array, over all of it: under `jax.vmap`, over every lane at once (its
# batching rule binds it on the batched array, with unbatched outputs), so a module vmapped
# over a batch or over tokens has one statistic per call, not one per lane. No derivative:
# the statistics are logged, not differentiated. Lowered behind an optimization barrier: XLA
# would otherwise share the statistics' arithmetic with the model's (an `x*x` with a GELU's
# derivative) and keep that shared array alive until the backward pass.
stats_p = _compat.Primitive("eqx_logs.stats")
stats_p.multiple_results = True
stats_p.def_impl(_compute)
stats_p.def_abstract_eval(
    lambda aval, *, stats: [
        _compat.ShapedArray((), jnp.int32 if name == "nonfinite" else _float_dtype(aval.dtype))
        for name in stats
    ]
)
_compat.def_no_derivative(stats_p)
_compat.def_batching(
    stats_p, lambda args, dims, *, stats: (stats_p.bind(*args, stats=stats), [None] * len(stats))
)
_compat.def_lowering(
    stats_p, lambda x, *, stats: _compute(lax.optimization_barrier(x), stats=stats)
)


def statistics(x: Array, stats: tuple[str, ...]) -> dict[str, Array]:
    """`{name: statistic of x}` for every name in `stats`, over all of `x` (and every vmap
    lane of it)."""
    return dict(zip(stats, stats_p.bind(jnp.asarray(x), stats=stats)))


def leaf_statistics(name: str, tree: Any, stats: tuple[str, ...]) -> dict[str, Array]:
    """`{"<name>/<leaf path>/<stat>": value}` for every array leaf of `tree` (a lone array:
    `"<name>/<stat>"`). Leaves that are not arrays (None, functions, Python scalars an
    Equinox module keeps static) are not statistics of anything and are skipped."""
    items = {}
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not eqx.is_array(leaf):
            continue
        where = "/".join(filter(None, (name, path_name(path))))
        for stat, value in statistics(leaf, stats).items():
            items[f"{where}/{stat}" if where else stat] = value
    return items


def log_stats(
    name: str,
    tree: PyTree[ArrayLike],
    *,
    stats: Sequence[str] = DEFAULT_STATS,
    tags: str | tuple[str, ...] = (),
    **steps: int | ArrayLike,
) -> None:
    """Log statistics of every array leaf of a pytree, each under a key of its own.

    The statistics are computed where the values are, on device; only the scalars are logged.
    Each is over the whole leaf: under `jax.vmap`, over all lanes together (one value, not
    one per lane).

    **Arguments:**

    - `name`: the prefix of the keys (scopes apply, as for `log`).
    - `tree`: a pytree (gradients, updates, a model, a dict of activations). Leaves that are
        not arrays (None, functions) are skipped.
    - `stats`: names from `"mean"`, `"std"`, `"rms"`, `"absmax"`, `"min"`, `"max"`,
        `"norm"` and `"nonfinite"` (the number of NaN and infinite elements). Statistics are
        computed in at least float32.
    - `tags`, `**steps`: as for `eqx_logs.log`.

    **Returns:**

    None. Each statistic is logged under `"<name>/<leaf path>/<stat>"`, the path as
    `jax.tree_util.keystr` writes it without the leading dot (`"grad/layers[0].weight/norm"`);
    a lone array under `"<name>/<stat>"`. Outside any `spool` or `tap` nothing is computed.

    !!! example

        ```python
        def step(model, x, y):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            eqx_logs.log_stats("grad", grads, stats=("norm",))  # one key per weight
            return loss
        ```
    """
    site = _call_site()
    if not isinstance(name, str):
        raise TypeError(f"eqx_logs.log_stats at {site} needs a string name, got {name!r}.")
    stats = check_stats(stats, f"eqx_logs.log_stats at {site}")
    if not _compat.logging_enabled.value:
        return None  # nothing computed: the program is the one without the call
    tags = _normalise_tags(tags, site)
    step_vals = {n: _check_step(n, s, site) for n, s in steps.items()}
    items = leaf_statistics(name, tree, stats)
    if not items:
        raise ValueError(
            f"eqx_logs.log_stats({name!r}) at {site}: the tree has no array leaves, so there "
            "is nothing to take statistics of."
        )
    prefix = current_prefix()
    if prefix:
        items = {f"{prefix}/{k}": v for k, v in items.items()}
    bind(items, step_vals, tags=tags, site=site)
