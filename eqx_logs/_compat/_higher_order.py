"""The higher-order primitives, by name (names are stable across versions; objects move)."""

from collections.abc import Sequence
from typing import Any

from jax import lax as _lax
from jax._src import core as _core
from jax._src.lax.control_flow import conditionals as _conditionals
from jax.tree_util import tree_leaves as _tree_leaves

from ._types import ClosedJaxprType, Jaxpr, JaxprEqn

HIGHER_ORDER = frozenset({"cond", "scan", "while", "pjit", "jit", "remat2", "checkpoint"})
INLINE_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "named_call", "eval_jaxpr"})
# Outside vmap, a custom_vmap call is its function (under a vmap inside the spool, JAX has
# already applied the rule).
CUSTOM_VMAP = "custom_vmap_call"
SCAN = "scan"
SHARD_MAP = "shard_map"  # `jax.shard_map`, and `jax.pmap` (a jit of a shard_map)
WHILE = "while"
COND = "cond"
REMAT = frozenset({"remat2", "checkpoint", "remat"})
CUSTOM_JVP = "custom_jvp_call"
CUSTOM_VJP = "custom_vjp_call"
CUSTOM_CALLS = frozenset({CUSTOM_JVP, CUSTOM_VJP})


def call_jaxpr(eqn: JaxprEqn) -> Any:
    """The jaxpr of a call-like equation (jit, closed_call, remat, custom_jvp/vjp)."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr", "call"):
        if name in eqn.params:
            return eqn.params[name]
    raise NotImplementedError(f"eqx_logs: cannot find the jaxpr of {eqn.primitive.name}")


def shard_map_parts(eqn: JaxprEqn) -> tuple[Any, Any, tuple, tuple, tuple[str, ...], bool]:
    """A shard_map's body (a jaxpr without constants), mesh, in and out specs (one per operand
    and result), its manual axes in mesh order, and `check_vma`."""
    p = eqn.params
    mesh = p["mesh"]
    manual = p["newly_manual_axes"] if "newly_manual_axes" in p else p["manual_axes"]
    axes = tuple(name for name in mesh.axis_names if name in manual)
    check = p["check_vma"] if "check_vma" in p else p["check_rep"]
    return p["jaxpr"], mesh, tuple(p["in_specs"]), tuple(p["out_specs"]), axes, check


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes over which `x` varies (in a `shard_map` with `check_vma`)."""
    return frozenset(_core.typeof(x).mat.varying)


def vary(x: Any, axes: tuple[str, ...]) -> Any:
    """`x` varying over the manual mesh `axes` (in a `shard_map` with `check_vma`), as a value
    computed from a device's own data is; a constant or a `psum` is not. States a loop carries
    there keep one type however the events they take in vary."""
    varying = varying_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    return _lax.pcast(x, missing, to="varying") if missing else x


def scan_parts(eqn: JaxprEqn) -> tuple[Any, int, int]:
    """`(body, num_consts, num_carry)` of a scan equation."""
    params = eqn.params
    if "num_consts" in params:
        return params["jaxpr"], params["num_consts"], params["num_carry"]
    # jax 0.12: a flat tree (consts, carry, xs) describes the operands.
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return params["jaxpr"], len(list(consts)), len(list(carry))


def scan_options(eqn: JaxprEqn) -> dict[str, Any]:
    params = eqn.params
    return dict(length=params["length"], reverse=params["reverse"], unroll=params["unroll"])


def while_parts(eqn: JaxprEqn) -> tuple[Any, int, Any, int]:
    """`(cond_jaxpr, cond_nconsts, body_jaxpr, body_nconsts)` of a while equation."""
    p = eqn.params
    return p["cond_jaxpr"], p["cond_nconsts"], p["body_jaxpr"], p["body_nconsts"]


def cond_branches(eqn: JaxprEqn) -> tuple[Any, ...]:
    return tuple(eqn.params["branches"])


def cond_platforms(eqn: JaxprEqn) -> tuple[tuple[str, ...] | None, ...] | None:
    """For a cond made by `lax.platform_dependent`, the platforms of each branch (None for
    the default one); None for a cond on a value."""
    return eqn.params.get("branches_platforms")


def switch(index: Any, branches: Sequence[Any], *operands: Any, platforms: Any = None) -> Any:
    """`lax.switch(index, branches, *operands)`; with `platforms` (`cond_platforms`), the
    switch of a `lax.platform_dependent`, which JAX lowers with the branch of the platform
    it lowers for alone (the others may not lower there: code for one kind of device)."""
    if platforms is None:
        return _lax.switch(index, branches, *operands)
    return _conditionals._switch_internal(index, branches, operands, branches_platforms=platforms)


LINEAR_SOLVE = "custom_linear_solve"


def linear_solve_parts(eqn: JaxprEqn) -> tuple[dict[str, Any], dict[str, list[Any]], int]:
    """`(jaxprs, const_indices, num_consts)` of a custom_linear_solve equation: the jaxprs of
    `matvec`, `vecmat`, `solve` and `transpose_solve` (None where absent) by name, and the
    positions of each one's constants among the operands (then come the right-hand sides)."""
    jaxprs, lengths = eqn.params["jaxprs"], eqn.params["const_lengths"]
    names = ("matvec", "vecmat", "solve", "transpose_solve")
    out, positions, start = {}, {}, 0
    for name in names:
        out[name] = getattr(jaxprs, name)
        n = getattr(lengths, name)
        positions[name] = list(range(start, start + n))
        start += n
    return out, positions, start


# jax >= 0.12 binds some higher-order functions as "hi" primitives (`lax.custom_root` among
# them): an object of their own in the parameters, with the jaxprs it needs.
HI_CALL = "call_hi_primitive"


def hi_name(eqn: JaxprEqn) -> str | None:
    """The kind of a hi primitive's equation (`'SearchSorted'`, `'Scan3'`); else None."""
    prim = eqn.params.get("_prim") if eqn.primitive.name == HI_CALL else None
    return None if prim is None else type(prim).__name__


def hi_forward(eqn: JaxprEqn) -> tuple[Any, int] | None:
    """For a hi primitive whose forward computation is a jaxpr of its first operands (the
    `solve` of `lax.custom_root`): that jaxpr and how many operands it takes; else None."""
    prim = eqn.params.get("_prim")
    forward = getattr(prim, "params", {}).get("solve_jaxpr")
    if forward is None:
        return None
    return forward, len(_tree_leaves(prim.in_avals[:2]))


def remat_options(eqn: JaxprEqn) -> dict[str, Any]:
    return dict(prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])


def recomputes(eqn: JaxprEqn) -> bool:
    """Whether a remat `eqn` is the forward pass recomputed for a backward pass (its logs
    stay with the primal pass; what a primitive's own function would log there, too)."""
    return bool(eqn.params.get("differentiated", False))


def close(jaxpr: Jaxpr, consts: Sequence[Any]) -> Any:
    """A jaxpr with its constants, in the form `unpack` reads."""
    if ClosedJaxprType is not None:
        return ClosedJaxprType(jaxpr, list(consts))
    return jaxpr.with_consts(list(consts)) if consts else jaxpr
