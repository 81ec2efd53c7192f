"""The JAX types the rest of the package names, and the `ClosedJaxpr` shim (jax <= 0.11)."""

from jax._src import core as _core, effects as _effects

Jaxpr = _core.Jaxpr
JaxprEqn = _core.JaxprEqn
Literal = _core.Literal
DropVar = _core.DropVar
Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
Effect = _effects.Effect
# jax <= 0.11 wraps constants in a `ClosedJaxpr`; jax 0.12 attaches them to `Jaxpr` itself.
ClosedJaxprType = getattr(_core, "ClosedJaxpr", None)
closed_types = (Jaxpr,) if ClosedJaxprType is None else (Jaxpr, ClosedJaxprType)
