"""Equinox's primitives, whose implementation JAX runs when it lowers them."""

import functools
import sys
from collections.abc import Callable
from typing import Any

from jax import tree_util as _tree_util

from ._types import JaxprEqn, Literal

# Equinox's primitives (`eqxi.create_vprim`: lineax's `linear_solve`, and `vprim`, any of them
# under vmap) run a Python implementation when JAX lowers them. The functions it calls are
# parameters: jaxprs (closure-converted, in `static`) or Python functions, traced only then.
# (`vprim`: a `linear_solve` under vmap; `noinline`: `eqx.internal.noinline`'s calls)
EQUINOX_PRIMITIVES = frozenset({"linear_solve", "vprim", "noinline"})


def equinox_impl(eqn: JaxprEqn) -> Callable[..., Any] | None:
    """The implementation JAX lowers `eqn` with, if Equinox defined its primitive; else None."""
    name = eqn.primitive.name
    if name == "noinline":
        # `eqx.internal.noinline(f)`: its impl calls `f` (a parameter, in no jaxpr)
        module = sys.modules.get("equinox.internal._noinline")
        index = eqn.invars[0]
        ours = eqn.primitive is getattr(module, "noinline_p", None)
        if not ours or not isinstance(index, Literal):
            return None
        impl = functools.partial(eqn.primitive.impl, **eqn.params)
        # the function's index in Equinox's registry, read as a Python value: the literal
        return lambda _, *args: impl(index.val, *args)
    if name == "vprim":  # under vmap: another vprim's (Equinox's loops' `maybe_set`: no)
        name = getattr(eqn.params.get("prim"), "name", None)
    if name not in EQUINOX_PRIMITIVES:
        return None
    module = sys.modules.get("equinox.internal._primitive")
    impl = getattr(module, "_vprim_impl_registry", {}).get(eqn.primitive)
    return None if impl is None else functools.partial(impl, **eqn.params)


def derivative_noinline(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is an `eqx.internal.noinline` call that JAX's AD made: its function under
    a JVP or transpose transform, which recomputes the forward pass (whose events the primal
    call has) to differentiate it."""
    if eqn.primitive.name != "noinline":
        return False
    noinline = sys.modules.get("equinox.internal._noinline")
    combine = getattr(sys.modules.get("equinox.internal._primitive"), "_combine", None)
    if noinline is None or combine is None:
        return False
    params = eqn.params
    _, _, transforms, _ = _tree_util.tree_unflatten(
        params["treedef"], combine(list(eqn.invars), params["static"])
    )
    derivative = (noinline._MetaTransposeTransform,)
    return any(t is noinline._jvp_transform or isinstance(t, derivative) for t in transforms)
