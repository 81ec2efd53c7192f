"""`sow` and `plant`: logged values that can be replaced (oryx's `plant`, Penzai's activation
patching)."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import ArrayLike, PyTree

from . import _compat
from ._interpret import (
    Spool,
    known as _known,
    site_list as _site_list,
    vmap_n as _vmap,
)
from ._primitive import (
    bind,
    call_site,
    check_step,
    check_value,
    current_prefix,
    normalise_tags,
    sow_p,
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


class _Plant(Spool):
    """spool's handler counting the events of the planted keys (as states, threaded through
    loops and branches like a spool's), and replacing each sown value by its row of the
    planted values. Every log passes on to an enclosing spool or tap."""

    name = "eqx_logs.plant"

    def __init__(self, values: dict[str, Any]):
        self.values = values
        super().__init__(Policy(), RULES, keep=True)
        self.seen: set[str] = set()

    def statistics(self, eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        return _compat.bind_eqn(eqn, invals)  # a vmap around a plant may be inside a spool

    def reduction_of(self, key: str, site_reduce: Any) -> Any:
        return Count() if key in self.values else DROP

    def sown(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> Any:
        key, nbatch = eqn.params["key"], eqn.params["nbatch"]
        self.seen.add(key)
        if key not in self.values:
            return _compat.bind_eqn(eqn, invals)  # for an enclosing plant
        info = self.interp.plan.info[key]
        if key not in states:
            raise ValueError(
                f"eqx_logs.plant: the sown value {key!r} (at {_site_list(info.sites)}) is "
                "consumed by a spool inside the planted function; plant inside the spool: "
                "`spool(plant(f, values))`."
            )
        planted = self.values[key]
        xs = [jnp.asarray(x) for x in invals]
        leaves = jtu.tree_leaves(planted)
        if len(leaves) != len(xs):
            raise ValueError(
                f"eqx_logs.plant: {key!r} is sown as a pytree of {len(xs)} arrays (at "
                f"{_site_list(info.sites)}), but the planted value has {len(leaves)}."
            )
        count = states[key]["count"]  # events before this one (its log comes after)
        if mesh := self.interp.manual.local_axes(info):  # in a shard_map: the device's block,
            count = count.reshape(count.shape[mesh:])  # its mesh axes (of size 1) first
        return [self._row(key, v, x, count, nbatch) for v, x in zip(leaves, xs)]

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

        invariant = [a for a in self.interp.manual.vary if a not in _compat.varying_axes(x)]
        if invariant:
            raise ValueError(
                f"eqx_logs.plant: {key!r} is sown inside a shard_map (at {sites}) as a value "
                f"that does not vary over the mesh axes {invariant}, and one row per event "
                "would make it vary: each device takes the row of its own events. Plant one "
                "value for every event, or sow a value that varies over those axes (the "
                "device's own data)."
            )

        def take(rows, i):
            i = jnp.minimum(i, rows.shape[0] - 1)  # (rows past a while loop's end: unused)
            return lax.dynamic_index_in_dim(rows, i, 0, keepdims=False)

        rows = jnp.moveaxis(v, 0, nbatch)  # the row axis after the lanes
        return _vmap(take, nbatch)(rows, jnp.broadcast_to(count, x.shape[:nbatch]))


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
    closed, flat, rebuild = trace_filtered(fun, args, kwargs)
    plant = _Plant(values)
    outs, _ = plant.run(closed, flat)
    unknown = [k for k in values if k not in plant.seen]
    if unknown:
        logged = sorted(k for k in plant.interp.plan.info if k not in plant.seen)
        raise ValueError(
            f"eqx_logs.plant: {unknown[0]!r} is not sown in {_compat_name(fun)}; the keys "
            f"sown there are {sorted(plant.seen)}"
            + (f" (logged, not sown: {logged}; use `eqx_logs.sow`)" if logged else "")
            + "."
        )
    return rebuild(outs)


def _compat_name(fun: Callable) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__name__


def plant(fun: Callable[..., _T], values: Mapping[str, PyTree[ArrayLike]]) -> Callable[..., _T]:
    """`fun` with the values sown ([`eqx_logs.sow`][]) under some keys replaced.

    **Arguments:**

    - `fun`: a function that calls [`eqx_logs.sow`][], at any depth (a model, a scan body).
    - `values`: a dict from key to the value to plant: with the sown value's shape (the
        same for every event of the key), or with a leading axis of one row per event, in
        the order a spool stacks them (so a `LogDict` from `spool(f)` replays: under a
        `jax.vmap` inside `fun`, rows are `(events, batch, ...)` as spool returns them).

    **Returns:**

    A function with the signature of `fun`. Each sown value of a planted key is replaced
    (the i-th event by row i); other sown values pass. Unknown keys, and shapes that fit
    neither form, raise when it is traced. It composes with `spool` (place it inside:
    `spool(plant(f, values))` records the planted values), `jax.jit`, `jax.grad` (planted
    values are constants, or differentiable if passed as traced arrays) and `jax.vmap`.

    !!! example

        ```python
        def f(xs):
            def body(c, x):
                return c + eqx_logs.sow("x", x), None

            return jax.lax.scan(body, 0.0, xs)[0]

        eqx_logs.plant(f, {"x": jnp.array([10.0, 20.0, 30.0])})(jnp.ones(3))  # 60.0
        ```
    """
    if not callable(fun):
        raise TypeError(f"eqx_logs.plant expects a callable, got {type(fun).__name__}.")
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise TypeError(
            f"eqx_logs.plant(fun, values): values must be a dict from key to value, got "
            f"{type(values).__name__}."
        )
    values = {k: jax.tree.map(jnp.asarray, v) for k, v in values.items()}
    return build_wrapper(_Planted, fun, values)
