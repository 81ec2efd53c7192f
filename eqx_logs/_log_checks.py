"""The checks of what `log`, `log_grad`, `scope`, `sow` and `log_stats` are given: values,
steps, tags and reductions, each error naming the call site."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._reduce import as_reduction

# Attributes of LogDict that a step name would shadow.
# LogDict's attributes, and the fields of a logger's records (`loggers.records`)
RESERVED_STEP_NAMES = frozenset({"count", "steps", "reductions", "rows", "key", "value", "run"})


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex)


def check_value(key: str, value: Any, site: str, *, empty: bool = False) -> list[Any]:
    """The leaves of `value`, logged under `key` at `site`, checked. `empty`: a value with no
    leaves, such as `()` (an event with no value, `log("tick", ())`), is allowed; one holding
    None never is (it is most often a value missing by mistake)."""
    try:
        leaves = jtu.tree_leaves(value)
    except (ValueError, TypeError, RecursionError, SystemError) as e:  # JAX's own pytree errors
        raise TypeError(
            f"eqx_logs.log: key {key!r} at {site} has a value that is not a valid pytree "
            f"({type(e).__name__}: {str(e)[:200]}): log a dict with keys of one type, nested "
            "at most a few hundred levels deep."
        ) from None
    if not leaves and (not empty or None in jtu.tree_leaves(value, is_leaf=_is_none)):
        raise ValueError(
            f"eqx_logs.log: key {key!r} at {site} has no array in its value {value!r:.60}."
            + (
                f" To count events without a value, log an empty tuple: log({key!r}, ()), "
                "with its steps if any (step=i)."
                if empty
                else ""
            )
        )
    for leaf in leaves:
        if not _is_arraylike(leaf):
            raise TypeError(
                f"eqx_logs.log: key {key!r} at {site} has a value of type "
                f"{type(leaf).__name__} ({leaf!r:.60}); only arrays, numpy arrays and Python "
                "numbers can be logged (log a number that encodes it, or put strings in tags)."
            )
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"eqx_logs.log: key {key!r} at {site} is a typed PRNG key; log "
                "`jax.random.key_data(key)` instead."
            )
        if isinstance(leaf, np.ndarray | np.generic) and leaf.dtype.kind in "OSUVMm":
            raise TypeError(
                f"eqx_logs.log: key {key!r} at {site} has a numpy array of dtype {leaf.dtype}; "
                "only numbers (bool, int, float, complex) can be logged."
            )
        _check_range(f"key {key!r}", leaf, site)
    return leaves


def _is_none(x: Any) -> bool:
    return x is None


def _check_range(what: str, x: Any, site: str) -> None:
    """A Python or numpy integer must fit the integer type JAX gives it (int32 without
    `jax_enable_x64`): JAX would otherwise wrap it silently (2**40 + 7 becomes 7)."""
    if isinstance(x, bool) or not isinstance(x, int | np.integer | np.ndarray):
        return
    if isinstance(x, np.ndarray) and (x.dtype.kind not in "iu" or x.size == 0):
        return
    dtype = jnp.int64 if isinstance(x, int) else np.asarray(x).dtype
    target = jnp.iinfo(jax.dtypes.canonicalize_dtype(dtype))
    lo, hi = (int(np.min(x)), int(np.max(x))) if isinstance(x, np.ndarray) else (int(x), int(x))
    if lo < target.min or hi > target.max:
        raise OverflowError(
            f"eqx_logs.log: {what} at {site} holds {hi if hi > target.max else lo}, outside "
            f"{target.dtype} (the type JAX gives it here, and would wrap it to); enable "
            "`jax_enable_x64`, or log a float."
        )


def check_step(name: str, value: Any, site: str) -> jax.Array:
    if name in RESERVED_STEP_NAMES:
        raise ValueError(
            f"eqx_logs.log: step name {name!r} at {site} is reserved by LogDict and the "
            f"loggers' records ({sorted(RESERVED_STEP_NAMES)}); choose another name such as "
            "'iteration'."
        )
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and isinstance(value, jax.Array | np.ndarray | np.generic):
        ok = jnp.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value), jnp.integer)
    if not ok:
        raise TypeError(
            f"eqx_logs.log: step {name}={value!r:.60} at {site} must be an integer scalar "
            "(a Python int or an integer array of shape ()), for example `step=i`. Keyword "
            f"arguments are step names; to log {name!r} as a value, pass it in the dict: "
            f"log({{{name!r}: ...}})."
        )
    _check_range(f"step {name!r}", value, site)
    return jnp.asarray(value)


def check_reduce(reduce: Any, site: str) -> None:
    as_reduction(reduce, where=f"eqx_logs.log at {site}: reduce")
    try:
        hash(reduce)
    except TypeError:
        raise TypeError(
            f"eqx_logs.log at {site}: reduce={reduce!r} must be hashable (it is recorded when "
            "tracing); pass array fields such as a Sample key to spool instead."
        ) from None


def normalise_tags(tags: Any, site: str) -> tuple[str, ...]:
    try:
        out = (tags,) if isinstance(tags, str) else tuple(tags)
    except TypeError:
        out = None
    if out is None or not all(isinstance(t, str) for t in out):
        raise TypeError(
            f"eqx_logs.log: tags at {site} must be a string or a tuple of strings, such as "
            f"tags='train' or tags=('train', 'debug'); got {tags!r}."
        )
    return out
