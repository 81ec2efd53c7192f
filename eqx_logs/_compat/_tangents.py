"""Tangents and cotangents as JAX's rules receive them: symbolic zeros, the operands a
transpose rule gets as undefined (the linear ones); the aval of a value over some leading axes
of another (a sown value's event index)."""

from typing import Any

from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax.sharding import PartitionSpec as _P


def is_zero(t: Any) -> bool:
    """Whether `t`, a tangent or cotangent a rule received, is JAX's symbolic zero."""
    return type(t) is _ad.Zero


def zero_tangent(x: Any) -> Any:
    """The symbolic zero tangent of the primal `x` (what a jvp rule returns for an output
    that does not depend on the differentiated inputs)."""
    return _ad.Zero(_core.typeof(x).to_tangent_aval())


def instantiate(t: Any) -> Any:
    """`t` as an array: a symbolic zero made concrete."""
    return _ad.instantiate_zeros(t)


def is_linear_operand(x: Any) -> bool:
    """Whether `x`, an operand a transpose rule received, is one it transposes with respect
    to (JAX's undefined primal), rather than a known value."""
    return _ad.is_undefined_primal(x)


def leading_axes_aval(aval: Any, n: int, dtype: Any) -> Any:
    """An aval of `aval`'s first `n` axes and `dtype`, sharded over them as `aval` is and
    varying over the same manual (shard_map) axes, as a reduction over the others gives."""
    sharding = aval.sharding.update(spec=_P(*tuple(aval.sharding.spec)[:n]))
    return aval.update(shape=tuple(aval.shape[:n]), dtype=dtype, weak_type=False, sharding=sharding)
