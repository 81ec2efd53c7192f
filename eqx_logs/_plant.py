"""`sow` and `plant`: logged values, and instrumented submodules' outputs, that can be
replaced (oryx's `plant`, Penzai's activation patching); `at`, to replace some events only."""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Int, PyTree

from . import _compat
from ._deferred import force
from ._interpret import (
    Spool,
    keys_of as _keys_of,
    known as _known,
    site_list as _site_list,
    vmap_n as _vmap,
)
from ._primitive import (
    PLANT_TAG,
    bind,
    call_site,
    check_step,
    check_value,
    current_prefix,
    normalise_tags,
    sow_p,
    sow_tangent_p,
    tracing_context,
)
from ._reduce import DROP, Count, Policy
from ._rules import RULES
from ._spool import trace_filtered
from ._wrapper import AbstractWrapper, build_wrapper, carrying

_T = TypeVar("_T")


def sow(
    name: str,
    x: PyTree[ArrayLike],
    *,
    tags: str | tuple[str, ...] = (),
    **steps: int | ArrayLike,
) -> PyTree[ArrayLike]:
    """Log `x` under `name`, as [`eqx_logs.log`][] does, and return it; [`eqx_logs.plant`][] can
    replace what it returns.

    **Arguments:**

    - `name`: the key (scopes apply).
    - `x`: a pytree of arrays.
    - `tags`, `**steps`: as for [`eqx_logs.log`][].

    **Returns:**

    `x`; under `plant(f, {name: value})`, the planted value instead (and that is what a spool
    records). Outside any spool, tap or plant it is `x` itself and adds nothing to the
    program.

    !!! example

        ```python
        def f(x):
            h = eqx_logs.sow("h", jnp.sin(x))
            return 2 * h

        eqx_logs.plant(f, {"h": jnp.zeros(3)})(jnp.ones(3))  # [0., 0., 0.]
        ```
    """
    site = call_site()
    if not isinstance(name, str) or not name:
        raise TypeError(f"eqx_logs.sow at {site} needs a non-empty string name, got {name!r}.")
    check_value(name, x, site)
    tags = normalise_tags(tags, site)
    step_vals = {n: check_step(n, s, site) for n, s in steps.items()}
    if not _compat.logging_enabled.value:
        return x
    prefix = current_prefix()
    key = f"{prefix}/{name}" if prefix else name
    leaves, treedef = jtu.tree_flatten(x)
    leaves = sow_p.bind(*[jnp.asarray(v) for v in leaves], key=key, nbatch=0)
    y = jtu.tree_unflatten(treedef, leaves)
    bind({key: y}, step_vals, tags=tags, site=site)
    return y


class _At(eqx.Module):
    """`at(index, replacement)`: a planted value for some events of a key only."""

    index: tuple[int, ...] | Int[Array, "..."]  # (Python ints: known at trace time)
    replacement: Any


def _indices(index: Any) -> tuple[int, ...] | Int[Array, "..."]:
    """`at`'s `index`: Python and numpy integers as a tuple (known at trace time), a JAX array
    (possibly traced) as it is; checked."""

    def integer(i: Any) -> bool:
        return isinstance(i, int | np.integer) and not isinstance(i, bool)

    if isinstance(index, np.ndarray) and index.ndim <= 1:
        index = index.tolist()
    if integer(index):
        index = (int(index),)
    elif isinstance(index, Sequence) and index and all(integer(i) for i in index):
        index = tuple(int(i) for i in index)
    elif isinstance(index, jax.Array) and jnp.issubdtype(index.dtype, jnp.integer):
        if index.ndim > 1:
            raise ValueError(f"eqx_logs.at: index has shape {index.shape}; give at most 1 axis.")
        return index
    else:
        raise TypeError(
            "eqx_logs.at(index, replacement): index is an event's index among the key's "
            "events (an int), a non-empty sequence of them, or an integer array; got "
            f"{index!r}."
        )
    if min(index) < 0:
        raise ValueError(
            f"eqx_logs.at: index {index} is negative; events are counted from 0 (the number "
            "of a key's events may not be known before the run)."
        )
    return index


def at(
    index: int | Sequence[int] | Int[ArrayLike, "..."],
    replacement: Callable[[PyTree[Array]], PyTree[Array]] | PyTree[ArrayLike],
) -> Any:
    """A value for [`eqx_logs.plant`][] that replaces some events of its key only: the
    event(s) numbered `index`, counted from 0 in the order a spool stacks the key's events.
    The others keep their sown value.

    **Arguments:**

    - `index`: an int, a sequence of them, or an integer JAX array of at most one axis
        (traced, for example under a `jax.vmap` over which layer to patch). In a scanned
        stack of layers (`eqx.filter_vmap`-stacked, applied in `lax.scan`), the layer.
    - `replacement`: what `plant` takes for the selected events: a function of the sown
        value, a value, or one row per event (row `i` for event `i`).

    **Returns:**

    A value to plant: `plant(f, {"layers": eqx_logs.at(3, fn)})`. A function is called on
    the selected events only (inside a `lax.cond` where the event's index is known only
    when the program runs, as in a loop).

    !!! example

        ```python
        def f(xs):
            def body(c, x):
                return c + eqx_logs.sow("x", x), None

            return jax.lax.scan(body, 0.0, xs)[0]

        eqx_logs.plant(f, {"x": eqx_logs.at(1, lambda x: 10 * x)})(jnp.ones(3))  # 12.0
        ```
    """
    if isinstance(replacement, _At):
        raise TypeError("eqx_logs.at(index, replacement): replacement cannot be an `at` itself.")
    return _At(_indices(index), replacement)


class _Plant(Spool):
    """spool's handler counting the events of the planted keys (as states, threaded through
    loops and branches like a spool's), and replacing each sown value by what is planted for
    it. Every log passes on to an enclosing spool or tap, but those of the instrumented
    submodules' outputs (`plant_point`), which pass on only to an enclosing plant."""

    name = "eqx_logs.plant"

    def __init__(self, values: dict[str, Any]):
        self.values = values
        super().__init__(Policy(), RULES, keep=True)
        self.seen: set[str] = set()  # the keys sown with `sow`
        self.paths: set[str] = set()  # the paths of instrumented submodules
        self.nested = _compat.planting.value is not None  # inside another plant's trace

    def selects(self, tags: tuple[str, ...]) -> bool:
        del tags
        return True  # every event: its planted keys' are counted, the others pass on

    def passes_on(self, eqn: _compat.JaxprEqn) -> bool:
        return self.nested or PLANT_TAG not in eqn.params["tags"]

    def event(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> None:
        if self.passes_on(eqn) or any(k in self.values for k in _keys_of(eqn)):
            super().event(eqn, invals, states)

    def statistics(self, eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        return _compat.bind_eqn(eqn, invals)  # a vmap around a plant may be inside a spool

    def reduction_of(self, key: str, site_reduce: Any) -> Any:
        return Count() if key in self.values else DROP

    def sown(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> Any:
        if eqn.primitive is sow_tangent_p:
            return self._derivative(eqn, invals)
        key, nbatch = eqn.params["key"], eqn.params["nbatch"]
        hidden = eqn.params.get("hidden", False)  # an instrumented submodule's output
        (self.paths if hidden else self.seen).add(key)
        if key not in self.values:  # for an enclosing plant
            return _compat.bind_eqn(eqn, invals) if self.nested or not hidden else force(invals)
        info = self.interp.plan.info.get(key)
        if info is None:
            raise ValueError(
                f"eqx_logs.plant: the sown value {key!r} (at {_compat.eqn_location(eqn)}) is "
                "consumed by a spool inside the planted function; plant inside the spool: "
                "`spool(plant(f, values))`."
            )
        xs = [jnp.asarray(x) for x in invals]
        if key in states:
            count = states[key]["count"]  # events before this one (its log comes after)
            if mesh := self.interp.manual.local_axes(info):  # in a shard_map: the device's
                count = count.reshape(count.shape[mesh:])  # block, its mesh axes (size 1) first
        else:  # the forward pass computed again for a derivative (a remat's): no event
            count = self._uncounted(key, xs)
        outs = self._replaced(key, xs, count, nbatch)
        if not eqn.params.get("indexed", False):
            return outs
        # differentiated inside the planted function: the event's index, which its derivative
        # reads where `at` chooses events (else 0: known, so the derivative needs no residual)
        batch = xs[0].shape[:nbatch]
        if not isinstance(self.values[key], _At) or _known(count):
            known = count if isinstance(self.values[key], _At) else 0
            return [*outs, np.broadcast_to(np.asarray(known, np.int32), batch)]
        return [*outs, jnp.broadcast_to(jnp.asarray(count, jnp.int32), batch)]

    def _uncounted(self, key: str, xs: list[Any]) -> int:
        """The count for a sown value of `key` that is no event (its forward pass computed
        again for a derivative taken inside the planted function, where `jax.checkpoint`
        recomputes it): any, if what is planted is the same for every event; else raise."""
        planted = self.values[key]
        if callable(planted) or (
            not isinstance(planted, _At)
            and len(jtu.tree_leaves(planted)) == len(xs)
            and all(jnp.shape(v) == x.shape for v, x in zip(jtu.tree_leaves(planted), xs))
        ):
            return 0
        what = "by event (`eqx_logs.at`)" if isinstance(planted, _At) else "one row per event"
        raise ValueError(
            f"eqx_logs.plant: {key!r} (sown at {_site_list(self.interp.plan.info[key].sites)}) "
            f"is planted {what}, and differentiated inside the planted function through a "
            "`jax.checkpoint` (remat), whose backward pass computes the sown value again "
            "without knowing which event it is. Take the derivative outside the plant "
            "(`jax.grad(eqx_logs.plant(f, values))`), or plant a function or one value for "
            "every event."
        )

    def _replaced(self, key: str, xs: list[Any], count: Any, nbatch: int) -> list[Any]:
        """The sown leaves `xs` of an event of `key` (the `count`-th) replaced."""
        planted, hits = self.values[key], True
        if isinstance(planted, _At):
            planted, hits = planted.replacement, self._hits(key, planted.index, count, xs, nbatch)
            if hits is False:
                return xs
        if callable(planted):
            return self._called(key, planted, xs, nbatch, hits)
        new = self._rows(key, planted, xs, count, nbatch)
        if hits is True:
            return new
        return [jnp.where(_lanes_first(hits, x), n, x) for n, x in zip(new, xs)]

    def _derivative(self, eqn: _compat.JaxprEqn, invals: list[Any]) -> list[Any]:
        """The derivative of what is planted, for a planted key differentiated inside the
        planted function (`_primitive.sow_tangent_p`: a jvp, or `transposed`, a vjp): zero
        for a value or a row (it does not depend on the inputs), `fn`'s at the sown value for
        a function `fn`, the sown value's own (the identity) for the events `at` leaves."""
        key, nbatch, ins, outs = (eqn.params[k] for k in ("key", "nbatch", "ins", "outs"))
        if key not in self.values:  # for an enclosing plant
            return _compat.bind_eqn(eqn, invals)
        index, *rest = force(invals)  # (the index as the plant gave it: known, if it is)
        n = len(rest) - len(ins)
        xs, linear = [jnp.asarray(x) for x in rest[:n]], [jnp.asarray(t) for t in rest[n:]]

        def unchanged(x, t):  # the sown value's own derivative: the identity
            by_leaf = dict(zip(ins, t))
            return [by_leaf[i] if i in by_leaf else jnp.zeros_like(x[i]) for i in outs]

        planted, hits = self.values[key], True
        if isinstance(planted, _At):
            planted, hits = planted.replacement, self._hits(key, planted.index, index, xs, nbatch)
            if hits is False:
                return unchanged(xs, linear)
        if not callable(planted):  # a value or a row: a constant
            same = unchanged(xs, linear)
            if hits is True:
                return [jnp.zeros_like(t) for t in same]
            return [jnp.where(_lanes_first(hits, t), 0, t) for t in same]
        transposed = eqn.params["transposed"]
        derivative = self._derivative_of(key, planted, ins, outs, nbatch, transposed)

        def lane(hit, *leaves):
            x, t = list(leaves[:n]), list(leaves[n:])
            if hit is None:
                return derivative(x, t)
            return lax.cond(hit, derivative, unchanged, x, t)

        if hits is True:
            return _vmap(functools.partial(lane, None), nbatch)(*xs, *linear)
        return _vmap(lane, nbatch)(hits, *xs, *linear)

    def _derivative_of(
        self, key: str, fn: Callable, ins: tuple, outs: tuple, nbatch: int, transposed: bool
    ) -> Callable:
        """`(x, t) -> derivative`, of `fn` planted at `key` on one example's leaves `x`: its
        jvp (tangents `t` of the leaves `ins`, those of the leaves `outs` returned) or, if
        `transposed`, its vjp (cotangents of its outputs' leaves `ins`, those of the sown
        leaves `outs` returned). Traced with logging off: `fn`'s logs are its primal call's."""
        info = self.interp.plan.info[key]
        call = self._call(key, fn, nbatch)

        def full(x, given):  # every leaf's (co)tangent: zeros but those of `ins`
            by_leaf = dict(zip(ins, given))
            return jtu.tree_unflatten(
                info.treedef,
                [by_leaf[i] if i in by_leaf else _zero_tangent(a) for i, a in enumerate(x)],
            )

        def derivative(x, t):
            primal = jtu.tree_unflatten(info.treedef, x)
            with tracing_context(enabled=False):
                if transposed:
                    _, vjp = jax.vjp(call, primal)
                    (got,) = vjp(full(x, t))
                else:
                    _, got = jax.jvp(call, (primal,), (full(x, t),))
            leaves = jtu.tree_leaves(got)
            return [leaves[i] for i in outs]

        return derivative

    def _hits(self, key: str, index: Any, count: Any, xs: list[Any], nbatch: int) -> Any:
        """Whether this event of `key` is one of `index` (`at`): a bool if known now, else a
        bool per lane."""
        batch = xs[0].shape[:nbatch]
        if isinstance(index, tuple):
            bound = self.store.bounds[key]
            if bound is not None and max(index) >= bound:
                raise ValueError(
                    f"eqx_logs.plant: {key!r} is sown {bound} times (at "
                    f"{_site_list(self.interp.plan.info[key].sites)}), but "
                    f"`eqx_logs.at({list(index)}, ...)` names event {max(index)}; events are "
                    "counted from 0."
                )
            if _known(count):
                hit = np.isin(count, index)
                if hit.size and np.all(hit == np.ravel(hit)[0]):
                    return bool(np.ravel(hit)[0])
        count = jnp.asarray(count)
        index = jnp.reshape(jnp.asarray(index), (1,) * count.ndim + (-1,))
        hit = jnp.any(count[..., None] == index.astype(count.dtype), axis=-1)
        self._check_varies(key, xs, "`eqx_logs.at` with an index known only when it runs")
        return jnp.broadcast_to(hit, batch)

    def _call(self, key: str, fn: Callable, nbatch: int) -> Callable:
        """`fn`, planted at `key`, as it is called on one example's sown value: checked, and
        varying over the shard_map's mesh axes as the sown value does (a cond needs it)."""
        info = self.interp.plan.info[key]
        vary = self.interp.manual.vary

        def call(x):
            y = fn(x)
            _check_returned(key, _site_list(info.sites), x, y, nbatch)
            if vary:
                y = jtu.tree_map(lambda a, b: _compat.vary(a, _compat.varying_axes(b)), y, x)
            return y

        return call

    def _called(self, key: str, fn: Callable, xs: list[Any], nbatch: int, hits: Any) -> Any:
        """`fn` of each sown value (of each lane's, under a vmap inside the planted function),
        where `hits` (True, or a bool per lane)."""
        info = self.interp.plan.info[key]
        call = self._call(key, fn, nbatch)

        def lane(hit, *leaves):
            x = jtu.tree_unflatten(info.treedef, leaves)
            y = call(x) if hit is None else lax.cond(hit, call, lambda x: x, x)
            return jtu.tree_leaves(y)

        if hits is True:
            return _vmap(functools.partial(lane, None), nbatch)(*xs)
        return _vmap(lane, nbatch)(hits, *xs)

    def _rows(self, key: str, planted: Any, xs: list[Any], count: Any, nbatch: int) -> Any:
        """The sown leaves `xs` replaced by `planted`: a value, or rows per event."""
        leaves = jtu.tree_leaves(planted)
        if len(leaves) != len(xs):
            raise ValueError(
                f"eqx_logs.plant: {key!r} is sown as a pytree of {len(xs)} arrays (at "
                f"{_site_list(self.interp.plan.info[key].sites)}), but the planted value has "
                f"{len(leaves)}."
            )
        return [self._row(key, v, x, count, nbatch) for v, x in zip(leaves, xs)]

    def _check_varies(self, key: str, xs: list[Any], what: str) -> None:
        """Raise if a value chosen per event (by `what`) would make the sown value `xs` vary
        over mesh axes of a shard_map it does not vary over."""
        vary = self.interp.manual.vary
        invariant = [a for a in vary if any(a not in _compat.varying_axes(x) for x in xs)]
        if invariant:
            sites = _site_list(self.interp.plan.info[key].sites)
            raise ValueError(
                f"eqx_logs.plant: {key!r} is sown inside a shard_map (at {sites}) as a value "
                f"that does not vary over the mesh axes {invariant}, and {what} would make it "
                "vary: each device counts its own events. Plant one value for every event, "
                "or sow a value that varies over those axes (the device's own data)."
            )

    def _row(self, key: str, v: Any, x: Any, count: Any, nbatch: int) -> Any:
        v = jnp.asarray(v)
        if v.shape == x.shape:  # the same value for every event
            return v.astype(x.dtype)
        bound = self.store.bounds[key]
        sites = _site_list(self.interp.plan.info[key].sites)
        if v.shape[1:] != x.shape:
            raise ValueError(
                f"eqx_logs.plant: {key!r} is sown with shape {x.shape} (at "
                f"{sites}); plant a value of that shape (the same for every event) or one row "
                f"per event, shape (events, *{x.shape}); got "
                f"{v.shape}."
            )
        if bound is not None and v.shape[0] < bound:
            raise ValueError(
                f"eqx_logs.plant: {key!r} is sown {bound} times (at "
                f"{sites}), but {v.shape[0]} rows were planted."
            )
        if v.shape[0] == 0:  # sown no times (a zero-length loop): this event never happens
            return x
        v = v.astype(x.dtype)
        if _known(count) and np.all(count == np.ravel(count)[:1]):
            return v[min(int(np.ravel(count)[0]), v.shape[0] - 1)]
        self._check_varies(key, [x], "one row per event")

        def take(rows, i):
            i = jnp.minimum(i, rows.shape[0] - 1)  # (rows past a while loop's end: unused)
            return lax.dynamic_index_in_dim(rows, i, 0, keepdims=False)

        rows = jnp.moveaxis(v, 0, nbatch)  # the row axis after the lanes
        return _vmap(take, nbatch)(rows, jnp.broadcast_to(count, x.shape[:nbatch]))


def _zero_tangent(x: Any) -> Any:
    """A zero (co)tangent of `x`: float0 for an integer or boolean leaf, as JAX wants."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _lanes_first(hits: Any, x: Any) -> Any:
    """`hits`, a bool per lane (the leading axes of `x`), broadcastable against `x`."""
    return jnp.reshape(hits, hits.shape + (1,) * (x.ndim - hits.ndim))


def _described(tree: Any) -> str:
    def leaf(a: Any) -> str:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return f"{a.dtype}{list(a.shape)}"
        return type(a).__name__

    return str(jtu.tree_map(leaf, tree)) if jtu.tree_leaves(tree) else repr(tree)


def _check_returned(key: str, sites: str, x: Any, y: Any, nbatch: int) -> None:
    """Raise unless `y`, what the function planted at `key` returned for the sown `x`, has its
    structure, shapes and dtypes."""
    same = jtu.tree_structure(y) == jtu.tree_structure(x) and all(
        getattr(b, "shape", None) == a.shape and getattr(b, "dtype", None) == a.dtype
        for a, b in zip(jtu.tree_leaves(x), jtu.tree_leaves(y))
    )
    if not same:
        raise ValueError(
            f"eqx_logs.plant: the function planted at {key!r} returned {_described(y)}, but "
            f"{key!r} is sown as {_described(x)} (at {sites}): it must return a value of the "
            "same structure, shapes and dtypes (cast with `.astype(x.dtype)`)."
            + (
                " Under the `jax.vmap` inside the planted function, it is called on one "
                "example: the shapes above are an example's."
                if nbatch
                else ""
            )
        )


class _Planted(AbstractWrapper):
    """`plant(fun, values)`: a pytree of `fun` and the values (see `AbstractWrapper`)."""

    fun: Callable
    values: dict[str, Any]

    shown: ClassVar[str] = "eqx_logs.plant"

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return carrying(self, "eqx_logs.plant", _Planted._run, args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if _compat.is_traced((args, kwargs, self.values)):
            return _plant_run(self.fun, self.values, args, kwargs)
        return _plant_call(self.fun, self.values, args, kwargs)


@eqx.filter_jit
def _plant_call(fun, values, args, kwargs):
    return _plant_run(fun, values, args, kwargs)


def _plant_run(fun: Callable, values: dict[str, Any], args: Any, kwargs: Any) -> Any:
    outer = _compat.planting.value or frozenset()  # (a derivative inside sees their keys)
    with _compat.planting(frozenset(values) | outer):  # instrumented submodules sow outputs
        closed, flat, rebuild = trace_filtered(fun, args, kwargs)
    plant = _Plant(values)
    outs, _ = plant.run(closed, flat)
    unknown = [k for k in values if k not in plant.seen and k not in plant.paths]
    if unknown:
        raise ValueError(_unknown_message(unknown[0], fun, plant))
    return rebuild(outs)


def _unknown_message(key: str, fun: Callable, plant: _Plant) -> str:
    paths = sorted(plant.paths)
    logged = sorted(
        k
        for k in plant.interp.plan.info
        if k not in plant.seen and k not in plant.paths and not k.startswith(tuple(paths))
    )
    return (
        f"eqx_logs.plant: {key!r} is not sown in {_compat_name(fun)}; the keys sown there are "
        f"{sorted(plant.seen)}"
        + (f" (logged, not sown: {logged}; use `eqx_logs.sow`)" if logged else "")
        + (
            f"; the paths of its instrumented submodules are {paths}."
            if paths
            else ". To plant a submodule's output by its path, call the model instrumented "
            "(`eqx_logs.instrument(model)`)."
        )
    )


def _compat_name(fun: Callable) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__name__


def _prepared(value: Any) -> Any:
    """A planted value as `plant` keeps it: arrays as JAX arrays; functions as they are."""
    if isinstance(value, _At):
        return _At(value.index, _prepared(value.replacement))
    if callable(value):
        return value
    return jax.tree.map(jnp.asarray, value)


def plant(
    fun: Callable[..., _T],
    values: Mapping[str, PyTree[ArrayLike] | Callable[[PyTree[Array]], PyTree[Array]]],
) -> Callable[..., _T]:
    """`fun` with the values sown ([`eqx_logs.sow`][]) under some keys, or the outputs of
    some instrumented submodules ([`eqx_logs.instrument`][]), replaced.

    **Arguments:**

    - `fun`: a function that calls [`eqx_logs.sow`][] or an instrumented model, at any depth
        (a model, a scan body).
    - `values`: a dict from key (a sown key, or the path of an instrumented submodule:
        `"layers[1]"`, scopes apply to both) to what replaces each of its events:
        - a function `fn`: the sown value `x` becomes `fn(x)`, which must have its
            structure, shapes and dtypes. `fn` is called where the value is sown, on what
            the code there sees: under a `jax.vmap` inside `fun`, on one example. It may
            close over traced values and log.
        - a value with the sown value's shape: the same for every event;
        - one row per event (a leading axis), in the order a spool stacks them (so a
            `LogDict` from `spool(f)` replays: under a `jax.vmap` inside `fun`, rows are
            `(events, batch, ...)` as spool returns them);
        - [`eqx_logs.at`][]`(index, replacement)`: one of these for some events only (by
            their index among the key's events: in a scanned stack of layers, the layer).

    **Returns:**

    A function with the signature of `fun`. Each event of a planted key is replaced; other
    sown values pass. Unknown keys, shapes that fit no form and functions that return
    another shape raise when it is traced, naming the key and where it is sown (an unknown
    key: the keys and paths there are). An instrumented submodule's planted output is what
    the rest of the model sees, and what its statistics are of. It composes with `spool`
    (place it inside: `spool(plant(f, values))` records the planted values), `jax.jit`,
    `jax.grad` (outside, `jax.grad(plant(f, values))`, or inside, `plant(jax.grad(f),
    values)`: the derivative is that of what is planted; gradients flow through a planted
    function, and into it from the sown value; planted arrays are constants, or
    differentiable if passed as traced arguments outside; inside, a first derivative only)
    and `jax.vmap` (inside and outside).

    !!! example

        ```python
        def f(xs):
            def body(c, x):
                return c + eqx_logs.sow("x", x), None

            return jax.lax.scan(body, 0.0, xs)[0]

        eqx_logs.plant(f, {"x": jnp.array([10.0, 20.0, 30.0])})(jnp.ones(3))  # 60.0
        eqx_logs.plant(f, {"x": lambda x: -x})(jnp.ones(3))  # -3.0

        mlp = eqx_logs.instrument(eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0)))
        # the MLP with the output of layers[1] replaced by zeros
        ablated = eqx_logs.plant(mlp, {"layers[1]": jnp.zeros_like})
        ablated(jnp.ones(2))  # mlp.layers[2](jax.nn.relu(jnp.zeros(8)))
        ```
    """
    if not callable(fun):
        raise TypeError(f"eqx_logs.plant expects a callable, got {type(fun).__name__}.")
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise TypeError(
            f"eqx_logs.plant(fun, values): values must be a dict from key to value, got "
            f"{type(values).__name__}."
        )
    values = {k: _prepared(v) for k, v in values.items()}
    return build_wrapper(_Planted, fun, values)
