"""`log` and `log_grad`: the user-facing functions that check what they are given and bind
the `log` primitive (`_primitive.py`) under the enclosing scopes."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import ArrayLike, PyTree

from . import _compat
from ._log_checks import check_reduce, check_step, check_value, normalise_tags
from ._primitive import bind, grad_tap, warn_dropped
from ._reduce import RANKED_FIELDS, Ranked, as_reduction, takes_ids
from ._scope import call_site, current_prefix, current_steps, local


class _Missing:
    """`log`'s second argument when none is given: `log(data)`, not `log(name, value)`. Its
    repr, `MISSING`, is what signatures show (`help(log)`, the API reference)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


_MISSING = _Missing()


def log(
    data: dict[str, PyTree[ArrayLike]] | str | None = None,
    value: PyTree[ArrayLike] = _MISSING,
    /,
    *,
    tags: str | tuple[str, ...] = (),
    reduce: Any = None,
    ids: ArrayLike | None = None,
    **steps: int | ArrayLike,
) -> None:
    """Log values from anywhere: a model, a scan body, a cond branch, a vmapped function.

    **Arguments:**

    - `data`: a dict from key (a string) to value (a pytree of arrays or Python numbers); or a
        key, with the value as the second argument: `log("loss", loss)`. A value with no
        array, `()`, makes an event with no value, a count only: `log("tick", (), step=i)`;
        a spool then gives `logs["tick"] == ()`, the events in `logs.count["tick"]` and their
        steps in `logs.step["tick"]`. (`None` is an error: most often a value missing by
        mistake.)
    - `tags`: strings that spool's and tap's `tags=`/`exclude=` filters select on.
    - `reduce`: the reduction for these keys, a name (`"mean"`) or a reduction; used unless a
        spool's Policy rule matches the key. Two sites naming different reductions for one key
        is an error.
    - `ids`: for a reduction that ranks elements ([`eqx_logs.TopK`][]): an integer array of
        the value's shape (of each leaf's, and of each key's when `data` has several), one id
        per element, such as the examples' indices in the dataset; TopK reports the id, and
        this call's steps, beside each element it keeps. Any other reduction of these keys
        (named here or chosen by a spool's Policy) is an error. `ids` is reserved: it is never
        a step name.
    - `**steps`: named integer scalars recorded beside every key of this call, for example
        `step=i, episode=e`; read back as `logs.step[key]`, `logs.episode[key]`.

    **Returns:**

    None. Outside any `spool` or `tap` this does nothing and adds nothing to compiled code.

    !!! example

        ```python
        def f(x):
            eqx_logs.log({"x": x, "x2": x**2}, step=0)
            return x + 1

        out, logs = eqx_logs.spool(f)(1.0)  # logs["x"] == [1.0], logs.step["x"] == [0]
        ```
    """
    site = call_site()
    if data is None:  # `log(loss=x)`: a value passed as a step
        names = ", ".join(f"{k}=..." for k in steps)
        example = next(iter(steps), "loss")
        raise TypeError(
            f"eqx_logs.log({names}) at {site} logs no value: keyword arguments are step names "
            f"(step=i), recorded beside the values. Log a value as "
            f"log({{{example!r}: x}}) or log({example!r}, x)."
        )
    if value is not _MISSING:
        if not isinstance(data, str):
            raise TypeError(
                f"eqx_logs.log(name, value) at {site} needs a string name, got "
                f"{type(data).__name__}; use log({{name: value}}) for several keys."
            )
        data = {data: value}
    elif not isinstance(data, dict):
        raise TypeError(
            f"eqx_logs.log at {site} takes a dict from key to value, or a name and a value; "
            f"got {type(data).__name__}."
        )
    if reduce is not None:
        check_reduce(reduce, site)
    tags = normalise_tags(tags, site)
    prefix = current_prefix()
    items = {}
    for key, val in data.items():
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"eqx_logs.log at {site}: keys must be non-empty strings known when tracing, "
                f"got {key!r} of type {type(key).__name__}."
            )
        check_value(key, val, site, empty=True)
        items[f"{prefix}/{key}" if prefix else key] = val
    step_vals = {name: check_step(name, s, site) for name, s in steps.items()}
    ranks = reduce is not None and takes_ids(as_reduction(reduce))
    if ids is not None or ranks:
        items = _ranked(items, ids, step_vals, reduce, ranks, site)
    if not _compat.logging_enabled.value:
        warn_dropped(site, getattr(local, "rule", None))  # a custom rule's, traced too late
        return None
    bind(items, step_vals, tags=tags, reduce=reduce, site=site)


def _ranked(
    items: dict[str, Any], ids: Any, steps: dict[str, Any], reduce: Any, ranks: bool, site: str
) -> dict[str, Ranked]:
    """`items` packed for a reduction that takes ids (`_reduce/_topk.py`): each value with
    `ids` (checked against each of its leaves) and the steps of this call and its scopes."""
    keys = ", ".join(map(repr, items))
    if reduce is not None and not ranks:
        raise ValueError(
            f"eqx_logs.log at {site}: `ids=` is given for {keys}, with reduce={reduce!r}, "
            "which does not take ids (it would reduce them as values). Use "
            "`reduce=eqx_logs.TopK(k)`, or log without `ids=`. (`ids` is reserved by `log`: "
            "it is never a step name.)"
        )
    steps = {**current_steps(), **steps}
    clash = sorted(set(steps) & set(RANKED_FIELDS))
    if clash:
        raise ValueError(
            f"eqx_logs.log at {site}: the step {clash[0]!r} of {keys} clashes with the "
            f"field of that name in TopK's output ({', '.join(RANKED_FIELDS)}); rename the "
            "step."
        )
    if ids is not None:
        ok = isinstance(ids, jax.Array | np.ndarray | np.generic | int | list | tuple)
        ids = jnp.asarray(ids) if ok and not isinstance(ids, bool) else None
        if ids is None or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(
                f"eqx_logs.log at {site}: `ids=` for {keys} must be an integer array (one id "
                "per element of the value, e.g. `jnp.arange(batch)`), got "
                f"{getattr(ids, 'dtype', type(ids).__name__)}."
            )
    out = {}
    for key, value in items.items():
        leaves = jtu.tree_leaves(value)
        if ids is not None:
            if not leaves:
                raise ValueError(
                    f"eqx_logs.log at {site}: key {key!r} has no value (`()`), so `ids=` has "
                    "no elements to name; log a value with its ids."
                )
            for leaf in leaves:
                if jnp.shape(leaf) != ids.shape:
                    raise ValueError(
                        f"eqx_logs.log at {site}: key {key!r} has a value of shape "
                        f"{jnp.shape(leaf)}, but `ids=` has shape {ids.shape}; `ids` must "
                        f"have the shape of the value, {jnp.shape(leaf)} (one id per element), "
                        "for every key and leaf of the call."
                    )
        out[key] = Ranked(value=value, ids=ids, steps=steps)
    return out


@dataclasses.dataclass(frozen=True)
class Cotangent:
    key: str
    statistics = False  # its items are cotangents, not statistics of them

    def __call__(self, ct: Any) -> dict[str, Any]:
        return {self.key: ct}


def log_grad(name: str, x: PyTree[ArrayLike]) -> PyTree[ArrayLike]:
    """Identity on `x`; in the backward pass, logs the cotangent of `x` under `name`.

    **Arguments:**

    - `name`: the key (scopes apply, as for `log`).
    - `x`: a pytree of floating-point arrays.

    **Returns:**

    `x`, unchanged.

    !!! example

        ```python
        def loss(w, x):
            h = eqx_logs.log_grad("dh", jnp.tanh(w * x))
            return jnp.sum(h**2)

        g, logs = eqx_logs.spool(jax.grad(loss))(w, x)  # logs["dh"][0] == d loss / d h
        ```
    """
    site = call_site()
    if not isinstance(name, str) or not name:
        raise TypeError(f"eqx_logs.log_grad at {site} needs a non-empty string name, got {name!r}.")
    check_value(name, x, site)
    if not _compat.logging_enabled.value:
        return x
    prefix = current_prefix()
    return grad_tap(Cotangent(f"{prefix}/{name}" if prefix else name), site, x)
