"""The lanes of `first_nonfinite="any"` under a `jax.vmap` inside the spool.

A jaxpr does not say which axes of a value a `vmap` inside it batched: by the time the
program is traced, the batching rules have rewritten each operation (moving batch axes where
they like: a matmul's may go last) and the vmap is gone. So while a spool with
`first_nonfinite="any"` traces its function (`marking`), the batching rule of each operation
(every rule JAX registers, wrapped once: `install`) brackets what it emits between two
equations of ours: `begin_p` before, `end_p` after, whose operands are the rule's batched
outputs and whose `axes` say where their batch axes are (a vmap around that, nested, adds
its own: `_end_batch`). The rewrite (`_nonfinite.py`) then checks each bracketed operation
per lane, at its `end_p`, and removes the brackets. Both carry `log_p`'s effect, so that
partial evaluation keeps them in place (in loops too), and lower to nothing.

The switch is part of the trace context (`_scope._context_key`): a `jax.jit` traced inside
such a vmap is traced again with its brackets rather than taken from a cache without them.
"""

import itertools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .. import _compat
from .._primitive import LogEffect, log_effect
from .._scope import lanes_marked, marking

begin_p = _compat.Primitive("eqx_logs.lanes_begin")
begin_p.multiple_results = True
end_p = _compat.Primitive("eqx_logs.lanes_end")
end_p.multiple_results = True


__all__ = ["begin_p", "end_p", "install", "is_bracket", "marking"]

for _prim in (begin_p, end_p):
    _prim.def_effectful_abstract_eval(lambda *avals, **params: ([], {log_effect}))
    _prim.def_impl(lambda *args, **params: [])
    _compat.def_lowering(_prim, lambda *args, **params: [])
    _compat.def_transpose(_prim, lambda cts, *args, **params: [None] * len(args))
    _compat.keep_in_loops(_prim, LogEffect)


def _jvp(prim):
    def jvp(primals, tangents, **params):
        del tangents
        prim.bind(*primals, **params)  # (the primal values, once)
        return [], []

    return jvp


for _prim in (begin_p, end_p):
    _compat.def_jvp(_prim, _jvp(_prim))
    _compat.def_primal_only(_prim)


def _batch_axes(axes: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """The batch axes of an operand after a new batch axis was inserted at `dim` (outer
    vmaps first)."""
    return (dim, *(a + (a >= dim) for a in axes))


def _end_batch(axis_data, args, dims, *, axes, **params):
    """A vmap around the vmap that bracketed the operation: its batch axes added."""
    del axis_data
    axes = tuple(a if d is None else _batch_axes(a, d) for a, d in zip(axes, dims))
    end_p.bind(*args, axes=axes, **params)
    return [], []


def _begin_batch(axis_data, args, dims, **params):
    del axis_data, dims
    begin_p.bind(*args, **params)
    return [], []


_compat.def_batching_with_axis(end_p, _end_batch)
_compat.def_batching_with_axis(begin_p, _begin_batch)


# Each bracket's number. Under a derivative, partial evaluation may put an `end_p` whose
# operands are tangents in another program than its `begin_p`: the numbers tell which end
# closes which begin.
_ids = itertools.count()


def _bracketing(prim: Any, rule: Callable) -> Callable:
    """`rule`, the batching rule of `prim`, with what it emits bracketed while `marking`."""
    multiple = prim.multiple_results

    def bracketed(axis_data, args, dims, **params):
        if not lanes_marked() or any(True for _ in _compat.sub_jaxprs(params)):
            return rule(axis_data, args, dims, **params)  # (what it holds is bracketed)
        ident = next(_ids)
        begin_p.bind(id=ident)
        outs, out_dims = rule(axis_data, args, dims, **params)
        values, at = (outs, out_dims) if multiple else ([outs], [out_dims])
        batched = [
            (x, d)
            for x, d in zip(values, at)
            if isinstance(d, int) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        ]
        axes = tuple((d,) for _, d in batched)
        end_p.bind(*(x for x, _ in batched), id=ident, name=prim.name, axes=axes)
        return outs, out_dims

    return bracketed


_installed = False


def install() -> None:
    """Bracket every batching rule registered now (once): those of JAX, Equinox and Flax,
    imported before eqx_logs is; not eqx_logs' own."""
    global _installed
    if _installed:
        return
    _installed = True
    _compat.wrap_every_batching(
        lambda prim, rule: rule if prim.name.startswith("eqx_logs") else _bracketing(prim, rule)
    )


def is_bracket(eqn: _compat.JaxprEqn) -> bool:
    return eqn.primitive is begin_p or eqn.primitive is end_p
