"""Statistics of arrays, reduced on device: `log_stats`, and what `instrument` logs."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, ArrayLike, PyTree

from . import _branching, _compat, _lanes
from ._checks import DEFAULT_STATS as DEFAULT_STATS, STATS as STATS, check_stats as check_stats
from ._primitive import (
    bind,
    call_site,
    check_step,
    current_prefix,
    event_mask,
    normalise_tags,
)


def _float_dtype(dtype: Any) -> Any:
    # statistics in at least float32: a bfloat16 activation's mean of squares overflows
    # (chosen by hand: strict dtype promotion has no path from float16 to float32)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.inexact) or dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


def _float(x: Array) -> Array:
    return x.astype(_float_dtype(x.dtype))


def _lane_wise(y: Array, axes: tuple[int, ...]) -> Array:
    """A lane's value `y`, broadcast against an array reduced over `axes`."""
    return jnp.reshape(y, y.shape + (1,) * len(axes))


def _kept_only(y: Array, kept: Array | None, empty: Any) -> Array:
    """`y` where the mask `kept` holds, `empty` elsewhere (all of `y` without a mask)."""
    return y if kept is None else jnp.where(kept, y, jnp.asarray(empty, y.dtype))


def _apply_mask(
    x: Array, mask: Array | None, lanes: int, axes: tuple[int, ...]
) -> tuple[Array, Array, Array | None, Array, Array]:
    """`(full, x, kept, size, denominator)`: `x` as it is, `x` with its masked elements 0,
    the mask broadcastable against `x` (None without one), the number of elements kept per
    lane, and that number but at least 1 (what the sums are divided by)."""
    n = math.prod(x.shape[lanes:])
    if mask is None:
        size = denominator = jnp.asarray(n, x.dtype)
        return x, x, None, size, denominator
    kept = jnp.reshape(mask, jnp.shape(mask) + (1,) * (x.ndim - jnp.ndim(mask)))
    full, x = x, jnp.where(kept, x, jnp.zeros((), x.dtype))
    per_kept = jnp.asarray(n // math.prod(kept.shape[lanes:]), x.dtype)  # per mask element
    size = jnp.sum(kept, axis=axes, dtype=jnp.int32).astype(x.dtype) * per_kept
    size = jnp.broadcast_to(size, x.shape[:lanes])
    denominator = jnp.maximum(size, jnp.ones((), x.dtype))
    return full, x, kept, size, denominator


def _careful_moments(
    x: Array,
    absmax: Array,
    kept: Array | None,
    denominator: Array,
    axes: tuple[int, ...],
    inexact: bool,
) -> tuple[Array, Array, Array, Array]:
    """`(mean, std, rms, nonfinite)` of `x` the careful way: scaled by a power of two
    (exactly), the variance taken around the mean, the NaN and infinite elements counted."""
    lanes = x.ndim - len(axes)
    finite = jnp.isfinite(absmax)
    # 2**-e with `absmax < 2**e`, between 2**-126 and 2**126: exact, no subnormals
    e = jnp.frexp(jnp.where(finite & (absmax > 0), absmax, jnp.ones_like(absmax)))[1]
    scale = jnp.ldexp(jnp.ones_like(absmax), -jnp.clip(e, -126, 126))
    y = x * _lane_wise(scale, axes)
    m = jnp.sum(y, axis=axes) / denominator
    d = _kept_only(y - _lane_wise(m, axes), kept, 0)
    # around the computed mean, corrected for its rounding error
    drift = jnp.sum(d, axis=axes) / denominator
    var = jnp.sum(jnp.square(d), axis=axes) / denominator - jnp.square(drift)
    var = jnp.maximum(var, jnp.zeros((), x.dtype))
    if inexact:
        count = jnp.sum(~jnp.isfinite(x), axis=axes, dtype=jnp.int32)
    else:
        count = jnp.zeros(x.shape[:lanes], jnp.int32)
    nonfinite = jnp.where(finite, 0, count).astype(jnp.int32)
    # NaN for a value that is not finite: an infinite `norm` is a finite value's
    # overflow, which `first_nonfinite` does not report (`overflows`)
    rms = jnp.where(finite, jnp.sqrt(var + jnp.square(m)) / scale, jnp.nan)
    return m / scale, jnp.sqrt(var) / scale, rms, nonfinite


def _moments(
    x: Array,
    absmax: Array,
    kept: Array | None,
    denominator: Array,
    zero: Array,
    axes: tuple[int, ...],
    need: set[str],
    inexact: bool,
) -> tuple[Array, Array, Array, Array]:
    """`(mean, std, rms, nonfinite)` of `x` (masked elements 0), from `sum x` and
    `sum x**2` where those serve in every lane, else by `lax.cond` from the careful path
    (`_careful_moments`), each lane keeping the quick path's values where they serve. Only
    the sums `need` asks for are taken (the others `zero`, a 0 per lane)."""
    lanes = x.ndim - len(axes)
    total = jnp.sum(x, axis=axes) if need & {"mean", "std"} else zero
    squares = jnp.sum(jnp.square(x), axis=axes) if need & {"std", "rms", "norm"} else zero
    mean, square = total / denominator, squares / denominator
    var = jnp.maximum(square - mean * mean, jnp.zeros((), x.dtype))
    ok = jnp.isfinite(absmax) & jnp.isfinite(total) & jnp.isfinite(squares)
    if need & {"std", "rms", "norm"}:  # squares of tiny values lose their digits
        ok = ok & ((square >= jnp.finfo(x.dtype).tiny) | (absmax == 0))
    if "std" in need:
        ok = ok & (var >= jnp.asarray(1e-3, x.dtype) * square)  # else it cancels

    def quick():
        return mean, jnp.sqrt(var), jnp.sqrt(square), jnp.zeros(x.shape[:lanes], jnp.int32)

    def careful():
        slow = _careful_moments(x, absmax, kept, denominator, axes, inexact)
        # lanes the quick path serves keep its values (all of them but one, usually)
        return tuple(jnp.where(ok, a, b) for a, b in zip(quick(), slow))

    return _branching.skippable(~jnp.all(ok), careful, quick)


def _compute(
    x: Array, mask: Array | None = None, *, stats: tuple[str, ...], lanes: int | None = None
) -> list[Array]:
    """The statistics `stats` of `x`, in at least float32: over all of it, or, with `lanes`,
    over all but its first `lanes` axes (independent runs: a `vmap` outside the spool), one
    statistic per lane. With `mask` (booleans, each axis of size 1 or that of `x`'s axis at
    its place: a mask of `x`'s leading axes), over the elements where it holds only: a lane
    of a `vmap` inside the spool that does not take a batched cond's branch (`masked`). The
    statistics of no elements are 0 (their events are masked too).

    In as few passes over `x` as a CPU makes (it runs each reduction as a loop of its own,
    and writes out an elementwise array that two reductions share):

    - the common case takes `max |x|`, `sum x` and `sum x**2`: reductions of `x` itself, each
      with its elementwise operation fused in, so nothing the size of `x` is written;
    - one `lax.cond` goes to a careful path where those cannot serve (in any lane): `x` has
      a NaN or an infinity (then `nonfinite` counts them, and the other statistics are not
      finite), the sums overflow (values past about 1e16) or the squares underflow (below
      about 1e-19), or the mean dwarfs the spread (the variance from the two sums would
      cancel). It scales `x` by a power of two (exactly) and takes the variance around the
      mean. So a finite array has finite statistics, but for a `norm` past the dtype's
      largest value, and `first_nonfinite` finds the value, not its statistic. On GPUs,
      where a conditional makes the host wait for the device, the careful path runs every
      time, each lane keeping the quick path's values where they serve (`_branching.py`).
    """
    need = set(stats)
    inexact = jnp.issubdtype(x.dtype, jnp.inexact)
    x = _float(x)
    lanes = lanes or 0
    axes = tuple(range(lanes, x.ndim))
    full, x, kept, size, denominator = _apply_mask(x, mask, lanes, axes)
    absmax = jnp.max(jnp.abs(x), axis=axes)
    zero = jnp.zeros(x.shape[:lanes], x.dtype)
    out: dict[str, Array] = {"absmax": absmax}
    if need & {"mean", "std", "rms", "norm", "nonfinite"}:
        moments = _moments(x, absmax, kept, denominator, zero, axes, need, inexact)
        mean, std, rms, nonfinite = moments
        norm = rms * jnp.sqrt(size)
        out.update(mean=mean, std=std, rms=rms, norm=norm, nonfinite=nonfinite)
    for name, reduce, empty in (("min", jnp.min, jnp.inf), ("max", jnp.max, -jnp.inf)):
        if name in need:
            value = reduce(_kept_only(full, kept, empty), axis=axes)
            out[name] = value if mask is None else jnp.where(size > 0, value, zero)
    return [out[name] for name in stats]


def overflows(key: str) -> bool:
    """Whether the statistic logged under `key` may be infinite for a finite value: a
    `norm` past the dtype's largest value (of a value that is not finite, it is NaN)."""
    return key == "norm" or key.endswith("/norm")


def path_name(path: Sequence[Any]) -> str:
    """A pytree path as `jax.tree_util.keystr` writes it, without the leading dot:
    `layers[0].weight`, `['w']`."""
    return jtu.keystr(tuple(path)).removeprefix(".")


# The statistics of one array. `lanes` tells a vmap inside the spool from one outside it:
#
# - bound by `log_stats` (and `instrument`), as the spool traces the user's function, it is
#   None: a `vmap` there is the model's batch (or its tokens), and the batching rule binds it
#   on the batched array, with unbatched outputs: one statistic per call, not one per lane;
# - the spool or tap that evaluates the equation binds it again with `lanes=0` (`per_lane`),
#   and from there each `vmap` is outside the spool (seeds, an ensemble, a sweep: independent
#   runs): its batching rule moves the batch axis in front and counts it as a lane, so each
#   lane gets the statistics it would have alone (`vmap(spool(f))(xs)[i] == spool(f)(xs[i])`).
#
# An optional second operand masks the elements (`masked`): a cond whose predicate a vmap
# batches runs its branches for every lane (`_masking.py`), and the statistics are over the
# lanes that take the branch only, as each event is. It is a mask of the array's leading
# axes; batching keeps it aligned with them. A vmap inside the spool moves its batch axis in
# front, and `nbatch` counts those axes: an Equinox loop whose lanes leave it one by one
# masks them (`lane_masked`), as it masks their events.
#
# No derivative: the statistics are logged, not differentiated. Lowered behind an
# optimization barrier: XLA would otherwise share the statistics' arithmetic with the model's
# (an `x*x` with a GELU's derivative) and keep that shared array alive until the backward
# pass.
stats_p = _compat.Primitive("eqx_logs.stats")
stats_p.multiple_results = True
stats_p.def_impl(
    lambda x, *mask, stats, lanes, nbatch: _compute(x, *mask, stats=stats, lanes=lanes)
)
stats_p.def_abstract_eval(
    lambda aval, *mask, stats, lanes, nbatch: [
        _compat.ShapedArray(
            aval.shape[: lanes or 0],
            jnp.int32 if name == "nonfinite" else _float_dtype(aval.dtype),
        )
        for name in stats
    ]
)
_compat.def_no_derivative(stats_p)


def _mask_at(mask: Array, mask_dim: int | None, dim: int) -> Array:
    """`mask`, batched along `mask_dim` (None: not batched), as a mask of the leading axes
    of an array batched along `dim`: its batch axis at `dim` (of size 1 if not batched)."""
    if mask_dim is None:
        return mask if mask.ndim <= dim else jnp.expand_dims(mask, dim)
    mask = jnp.moveaxis(mask, mask_dim, 0)
    mask = jnp.reshape(mask, mask.shape + (1,) * max(dim + 1 - mask.ndim, 0))
    return jnp.moveaxis(mask, 0, dim)


def _batch(args, dims, *, stats, lanes, nbatch):
    (x, *mask), (d, *mask_dims) = args, dims
    if lanes is None:  # a vmap inside the spool: over the batch too
        if d is None:  # the same array in every lane: its statistics, if any lane keeps it
            mask = [jnp.any(m, axis=md) for m, md in zip(mask, mask_dims)]
        else:  # (in front: the statistics are over every element, in any order)
            x, nbatch = jnp.moveaxis(x, d, 0), nbatch + 1
            mask = [_mask_at(m, md, 0) for m, md in zip(mask, mask_dims)]
        out = stats_p.bind(x, *mask, stats=stats, lanes=None, nbatch=nbatch)
        return out, [None] * len(stats)
    # a vmap outside it: one more lane, in front
    if d is None:  # only the mask is batched: each lane keeps its own elements of `x`
        (m,), (md,) = mask, mask_dims
        x = jnp.broadcast_to(x, (m.shape[md], *x.shape))
    else:
        x = jnp.moveaxis(x, d, 0)
    mask = [_mask_at(m, md, 0) for m, md in zip(mask, mask_dims)]
    return stats_p.bind(x, *mask, stats=stats, lanes=lanes + 1, nbatch=nbatch), [0] * len(stats)


_compat.def_batching(stats_p, _batch)
_compat.def_lowering(
    stats_p,
    lambda x, *mask, stats, lanes, nbatch: _compute(
        lax.optimization_barrier(x), *mask, stats=stats, lanes=lanes
    ),
)


def per_lane(eqn: _compat.JaxprEqn) -> _compat.JaxprEqn:
    """`eqn`, a statistics equation, as the spool or tap evaluating it binds it: from here
    on, each `vmap` around it is one of independent runs (see `stats_p`)."""
    if eqn.params["lanes"] is not None:
        return eqn
    return _compat.with_params(eqn, lanes=0)


def masked(eqn: _compat.JaxprEqn, invals: Sequence[Any], mask: Array) -> list[Array]:
    """Bind `eqn`, a statistics equation, on `invals` with all its elements masked by `mask`
    too (a scalar boolean: whether the lane takes the branch of a batched cond, or runs the
    body of a batched while loop): under the `vmap` that batches `mask`, the statistics are
    over the lanes where it holds (see `stats_p`)."""
    if jnp.ndim(mask) != 0:
        raise AssertionError(f"eqx_logs: a statistics mask of shape {jnp.shape(mask)}")
    x, *old = invals
    mask = jnp.asarray(mask, bool)
    if old:  # already masked (a batched cond inside another)
        mask = jnp.logical_and(old[0], mask)
    return stats_p.bind(x, mask, **eqn.params)


def lane_masked(eqn: _compat.JaxprEqn, invals: Sequence[Any], lane: Array) -> list[Array]:
    """Bind `eqn`, a statistics equation of a `vmap` inside the spool, on `invals` with its
    elements masked by `lane` too: a lane mask (outer lanes first, `_lanes.py`), the lanes
    still in the Equinox loop around it (the others run its body only to be discarded)."""
    x, *old = invals
    nbatch = eqn.params["nbatch"]
    mask = _lanes.fit(lane, jnp.shape(x)[:nbatch])
    for m in old:  # (a batched cond's: of the leading axes, some of them of size 1)
        m = jnp.reshape(m, jnp.shape(m) + (1,) * (nbatch - jnp.ndim(m)))
        mask = jnp.logical_and(m, mask)
    return stats_p.bind(x, mask, **eqn.params)


def statistics(x: Array, stats: tuple[str, ...]) -> dict[str, Array]:
    """`{name: statistic of x}` for every name in `stats`, over all of `x` (and every lane
    of a vmap inside the spool), those of the lanes that `masked_events` around keeps."""
    mask = (event_mask() or (None,))[0]
    if mask is None:
        out = stats_p.bind(jnp.asarray(x), stats=stats, lanes=None, nbatch=0)
    else:  # as `_Mask.statistics` masks them
        mask = mask if jnp.ndim(mask) == 0 else jnp.any(mask)
        out = stats_p.bind(jnp.asarray(x), mask, stats=stats, lanes=None, nbatch=0)
    return dict(zip(stats, out))


def leaf_statistics(name: str, tree: Any, stats: tuple[str, ...], site: str) -> dict[str, Array]:
    """`{"<name>/<leaf path>/<stat>": value}` for every array leaf of `tree` (a lone array:
    `"<name>/<stat>"`). Leaves that are not arrays (None, functions, Python scalars an
    Equinox module keeps static) are not statistics of anything and are skipped; an empty
    array has none, and is an error naming it (`site`: the call that asked)."""
    items = {}
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not eqx.is_array(leaf):
            continue
        where = "/".join(filter(None, (name, path_name(path))))
        if leaf.size == 0:
            raise ValueError(
                f"eqx_logs statistics at {site}: the array {where!r} (shape {leaf.shape}) "
                f"has no elements, so its statistics {stats} are not defined. Leave it out of "
                "the tree (for `instrument`, with `where=`), or log its shape instead."
            )
        for stat, value in statistics(leaf, stats).items():
            items[f"{where}/{stat}" if where else stat] = value
    return items


@dataclasses.dataclass(frozen=True)
class CotangentStats:
    """The backward-pass items of a value logged with its cotangent (`instrument(...,
    grads=True)`, `watch(..., grads=True)`): the statistics of the cotangent under `name`, or
    with `stats` None the cotangent itself. Hashable, as `grad_tap` needs."""

    name: str
    stats: tuple[str, ...] | None
    site: str

    @property
    def statistics(self) -> bool:
        return self.stats is not None

    def __call__(self, ct: Any) -> dict[str, Any]:
        if self.stats is None:
            return {self.name: ct}
        return leaf_statistics(self.name, ct, self.stats, self.site)


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
    Each is over the whole leaf: under a `jax.vmap` inside the spool, over all lanes together
    (one value, not one per lane), and in a `lax.cond` or `lax.while_loop` whose predicate
    that vmap batches, over the lanes that take the branch or run the iteration; under a
    `jax.vmap` outside it (`jax.vmap(spool(f))`, a batch of independent runs), per lane, as
    each run alone would have it. A leaf with no elements is an error.

    **Arguments:**

    - `name`: the prefix of the keys (scopes apply, as for `log`).
    - `tree`: a pytree (gradients, updates, a model, a dict of activations). Leaves that are
        not arrays (None, functions) are skipped.
    - `stats`: names from `"mean"`, `"std"`, `"rms"`, `"absmax"`, `"min"`, `"max"`,
        `"norm"` and `"nonfinite"` (the number of NaN and infinite elements). Statistics are
        computed in at least float32.
    - `tags`, `**steps`: as for `eqx_logs.log`. (`instrument`'s cotangent statistics carry
        its tag `"instrument"` and `"backward"`.)

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

        loss, logs = eqx_logs.spool(step)(model, x, y)
        logs["grad/layers[0].weight/norm"]  # the norm of layers[0].weight's gradient
        ```
    """
    site = call_site()
    if not isinstance(name, str):
        raise TypeError(f"eqx_logs.log_stats at {site} needs a string name, got {name!r}.")
    stats = check_stats(stats, f"eqx_logs.log_stats at {site}")
    if not _compat.logging_enabled.value:
        return None  # nothing computed: the program is the one without the call
    tags = normalise_tags(tags, site)
    step_vals = {n: check_step(n, s, site) for n, s in steps.items()}
    items = leaf_statistics(name, tree, stats, site)
    if not items:
        raise ValueError(
            f"eqx_logs.log_stats({name!r}) at {site}: the tree has no array leaves, so there "
            "is nothing to take statistics of."
        )
    prefix = current_prefix()
    if prefix:
        items = {f"{prefix}/{k}": v for k, v in items.items()}
    bind(items, step_vals, tags=tags, site=site, statistics=True)
