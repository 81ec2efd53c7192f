"""`first_nonfinite="any"`: the first operation whose output has a NaN or an infinity, in code
the user did not write, forward and backward, found on the device in one run.

The program is rewritten as `watch` rewrites it: the output of each operation that can turn
finite inputs into a non-finite output (a division, an `exp`, a matmul that overflows, ...)
is checked, and the checks of each straight run of operations are one event under
`CHECKED`: 0 if every output is finite, NaN if not, with the index of the first that is not
as its step `OPERATION`, logged at a site that lists the run's operations (each with its
address and the user's line). The spool's `first_nonfinite` search, which looks at every
event in execution order, then reports the first of them (with the loop iterations, the
vmap lane and the pass). Inside a shard_map each device checks its own operations, under a
key of their own (`checked_key`: a key is logged under one set of mesh axes), and the search
names the device. An operation that only moves or selects values (`reshape`,
`select_n`, `max`, `tanh`, ...), or scales them by a literal of at most 1 (`0.5 * x`),
cannot make a non-finite value of finite ones, so its output is not checked: where it is not
finite, an input was, and that was checked first (or is an input of the program, checked
on entry).
"""

import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from .._primitive import BACKWARD_TAG, bind
from .._scope import user_site
from .._wrapper import AbstractWrapper, build_wrapper, carrying
from ._rewrite import LOOPS, Watcher, retraced
from ._spec import CHECK_TAG, OPERATION, Watch, checked_key

_T = TypeVar("_T")

# Finite inputs give finite outputs: moving, selecting, comparing, bounded functions.
_FINITE_PRESERVING = frozenset(
    {
        "abs", "argmax", "argmin", "broadcast_in_dim", "ceil", "clamp", "concatenate", "copy",
        "copy_p", "cos", "cummax", "cummin", "device_put", "dynamic_slice",
        "dynamic_update_slice", "erf", "expand_dims", "floor", "gather", "imag", "iota",
        "is_finite", "logistic", "max", "min", "neg", "optimization_barrier", "pad", "real",
        "reduce_max", "reduce_min", "reshape", "rev", "round", "select_if_vmap", "select_n",
        "sharding_constraint", "sign", "sin", "slice", "sort", "squeeze", "stop_gradient",
        "tanh", "transpose",
    }
)  # fmt: skip
_GROUP = 8  # same-shaped arrays per reduction (32 measured no faster)
_ROWS = 64  # the first stage of a check reduces to at least this many maxima


def _inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _literal(v: Any) -> np.ndarray | None:
    """The value of an equation's operand written in the program, else None."""
    return np.asarray(v.val) if isinstance(v, _compat.Literal) else None


def _sentinel(v: Any) -> str | None:
    """Of an equation's operand: "nan" for a literal holding a NaN, "inf" for one holding an
    infinity (and no NaN), else None."""
    value = _literal(v)
    if value is None or value.dtype.kind not in "fc" or np.all(np.isfinite(value)):
        return None
    return "nan" if np.any(np.isnan(value)) else "inf"


def _identity(eqn: _compat.JaxprEqn) -> bool:
    """`max(x, -inf)` or `min(x, inf)` (`jnp.max(x, initial=-jnp.inf)`, as `jax.nn.softmax`
    writes it): `x` itself, whose infinity, if any, is not the literal's."""
    neutral = {"max": -math.inf, "min": math.inf}.get(eqn.primitive.name)
    return neutral is not None and any(_scalar(v) == neutral for v in eqn.invars)


def _widens(eqn: _compat.JaxprEqn) -> bool:
    """A conversion to a float type at least as wide (which cannot overflow)."""
    if eqn.primitive.name != "convert_element_type":
        return False
    src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    return np.dtype(dst).itemsize >= np.dtype(src).itemsize or not jnp.issubdtype(src, jnp.inexact)


def _scalar(v: Any) -> float | None:
    """The value of a literal real scalar operand, else None."""
    value = _literal(v)
    if value is None or value.size != 1 or value.dtype.kind not in "iuf":
        return None
    return float(value.item())


def _shrinks(eqn: _compat.JaxprEqn) -> bool:
    """Scaling by a literal no larger than 1 (`0.5 * x`, `x / 128`) or shifting by one (`x +
    1e-8`): a finite value stays finite (rounded, the result is at most the largest finite
    value, or half an ulp of it beyond, in a float type of 16 bits or more)."""
    name = eqn.primitive.name
    if name not in ("mul", "div", "add", "sub"):
        return False
    out = eqn.outvars[0].aval.dtype
    if not jnp.issubdtype(out, jnp.floating) or jnp.finfo(out).bits < 16:
        return False
    scalars = [_scalar(v) for v in eqn.invars]
    if name == "div":
        return scalars[1] is not None and abs(scalars[1]) >= 1
    return any(c is not None and abs(c) <= 1 for c in scalars)


def _largest(xs: list[Any]) -> list[Any]:
    """The largest magnitude of each of the arrays `xs`: finite where the array is, NaN
    where it holds a NaN (a maximum propagates NaN), else infinite.

    - One reduction of several arrays for each run of same-shaped ones: an elementwise
      chain that XLA fuses into one loop has its inputs read once, not once per array.
    - In two stages, to a row of maxima and then to one: XLA's CPU runs the first on each
      of its threads (a reduction to a scalar runs on one).
    - Not `all(isfinite(x))`, a reduction of booleans that a CPU runs several times slower;
      not `sum(x * 0)`, which XLA's simplifier breaks (`(x * 3) * 0` becomes `x * 0`, finite
      where `x * 3` overflows).
    """
    out = []
    for (shape, _), run in itertools.groupby(xs, lambda x: (jnp.shape(x), x.dtype)):
        run = list(run)
        for k in range(0, len(run), _GROUP):
            out += _group_largest(run[k : k + _GROUP], shape)
    return out


def _group_largest(xs: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """The largest magnitude of each of the arrays `xs` (all of `shape`): one reduction."""
    if not math.prod(shape):
        return [jnp.zeros((), _magnitude(x).dtype) for x in xs]  # (nothing to check)
    rows = 1  # the product of the fewest leading axes (not the last) that makes `_ROWS`
    for n in shape[:-1]:
        if rows >= _ROWS:
            break
        rows *= n
    parts = tuple(_magnitude(x).reshape(rows, -1) for x in xs)
    init = tuple(jnp.zeros((), m.dtype) for m in parts)
    largest = lax.reduce(parts, init, _max_each, (1,))
    return [jnp.max(m) for m in largest]


def _max_each(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    """The reduction's step (one function: JAX traces it once per signature, not per call)."""
    return tuple(map(lax.max, a, b))


def _magnitude(x: Any) -> Any:
    """`|x|` (of a complex `x`, the larger of its parts': `|z|` overflows where they do not)."""
    x = lax.stop_gradient(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return lax.max(lax.abs(lax.real(x)), lax.abs(lax.imag(x)))
    return lax.abs(x)


class _AnyNonfinite(Watcher):
    """Checks the output of every operation that can make a non-finite value: the checks of
    each straight run of operations (of one pass) are one event, whose step `OPERATION` is
    the first failing check's index in the run, and whose site lists the run's operations.

    A NaN or infinity written in the program is a sentinel the code means to make, and so is
    what is computed from it: a causal mask's `-inf`, the `inf` an optimistix solver starts
    its step size from. Each value computed from one (here: in the same straight run, or a
    call inlined into it) is followed, with the sentinel's kind, and an operation on it is
    checked for NaN only (an infinity it holds may be the sentinel's; `-inf - -inf` in a
    softmax whose row is all masked is NaN, found), or, from a NaN, not at all."""

    def __init__(self):
        super().__init__(Watch("*", stats=None, backward=True))
        # (value, site, operation, backward pass, NaN only)
        self.pending: list[tuple[Any, str, str, bool, bool]] = []
        self.sentinels: dict[int, tuple[Any, str]] = {}  # id -> (value, "inf" | "nan")
        # how the equation being evaluated is checked: "all", "nan" (only) or None (not)
        self.check: str | None = "all"
        self.mesh: tuple[str, ...] = ()  # the manual mesh axes of the shard_maps around it

    def equation(self, eqn, invals: list[Any], path: str, outer: tuple, counters) -> list[Any]:
        if eqn.primitive.name != _compat.SHARD_MAP:
            return self._checked(eqn, invals, path, outer, counters)
        # a shard_map's body is checked on each device, its checks a key of their own (the
        # spool's search keeps the lowest-numbered device that found one)
        # what was gathered before it is checked outside, under the outer key (the base's
        # flush before a nested jaxpr comes after `self.mesh` names the shard_map's axes)
        self.flush()
        mesh = self.mesh
        self.mesh = (*mesh, *_compat.shard_map_parts(eqn)[4])
        try:
            return self._checked(eqn, invals, path, outer, counters)
        finally:
            self.mesh = mesh

    def _checked(self, eqn, invals: list[Any], path: str, outer: tuple, counters) -> list[Any]:
        written = {_sentinel(v) for v in eqn.invars} - {None}
        followed = {self.sentinels[id(x)][1] for x in invals if id(x) in self.sentinels}
        # An operation on a NaN or infinity written in the program makes a sentinel the code
        # means to make (diffrax fills the rows of its outputs that no step reaches with
        # `x * inf`): it is not checked. What is computed from one is checked for NaN only;
        # from a NaN, not at all.
        if written or "nan" in followed:
            self.check = None
        else:
            self.check = "nan" if followed else "all"
        # (`log` reads `check`: an equation it logs evaluates nothing within)
        outs = super().equation(eqn, invals, path, outer, counters)
        kinds = followed | (set() if _identity(eqn) else written)
        if kinds:
            kind = "nan" if "nan" in kinds else "inf"
            self.sentinels.update((id(x), (x, kind)) for x in outs)
        return outs

    def watches(self, eqn: _compat.JaxprEqn) -> bool:
        name = eqn.primitive.name
        if name in _FINITE_PRESERVING or _widens(eqn) or _shrinks(eqn) or name in LOOPS:
            return False
        if any(True for _ in _compat.sub_jaxprs(eqn.params)):
            return False  # (what it contains is checked)
        return any(_inexact(v.aval) for v in eqn.outvars)

    def log(self, key: str, x: Any, site: str, eqn: _compat.JaxprEqn) -> Any:
        if jnp.issubdtype(x.dtype, jnp.inexact) and self.check is not None:
            address = key.split("watch/", 1)[-1]
            operation = f"{eqn.primitive.name} at {address}"
            backward = _compat.in_backward_pass(eqn)
            self.gather(x, site, operation, backward, nan_only=self.check == "nan")
        return x

    def gather(
        self, x: Any, site: str, operation: str, backward: bool, nan_only: bool = False
    ) -> None:
        if self.pending and self.pending[-1][3] != backward:
            self.flush()  # (one pass per event)
        self.pending.append((x, site, operation, backward, nan_only))

    def flush(self) -> None:
        if not self.pending:
            return
        largest = _largest([p[0] for p in self.pending])
        finite = jnp.stack(
            [~jnp.isnan(m) if p[4] else jnp.isfinite(m) for m, p in zip(largest, self.pending)]
        )
        table = json.dumps([[p[1], p[2]] for p in self.pending])
        value = lax.select(jnp.all(finite), jnp.float32(0), jnp.float32(np.nan))
        first = jnp.argmin(finite).astype(jnp.int32)  # (the first False)
        tags = (CHECK_TAG, BACKWARD_TAG) if self.pending[0][3] else (CHECK_TAG,)
        self.pending = []
        key = checked_key(self.mesh)
        bind({key: value}, {OPERATION: first}, tags=tags, site=table, reduce="count")


def checked(closed: Any, args: Sequence[Any]) -> Any:
    """`closed` (traced on `args`) with every operation that can make a non-finite value
    checked, and the program's inputs checked on entry, as a new jaxpr."""
    site = user_site()
    return retraced(lambda *xs: run_checked(closed, xs, site), args)


def run_checked(closed: Any, args: Sequence[Any], site: str | None = None) -> list[Any]:
    """`closed` evaluated on `args` in the current trace, checked as by `checked`: its inputs
    checked at `site` (default: the user's line that called in, `user_site`), each under
    the steps of the `scope` blocks around (`logger.jit`'s step)."""
    watcher, site = _AnyNonfinite(), site or user_site()
    for i, x in enumerate(args):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and np.size(x):
            watcher.gather(x, site, f"the function's input {i}", False)
    return watcher.eval(closed, args, "", ())


class _Checked(AbstractWrapper):
    """`fun` checked as by `first_nonfinite="any"` where it is traced (`check_with`): a
    pytree of `fun` (see `AbstractWrapper`)."""

    fun: Callable

    shown: ClassVar[str] = "first_nonfinite"

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return carrying(self, "first_nonfinite", _Checked._run, args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        from .._spool import trace_filtered  # (`_spool` imports this module)

        if not _compat.logging_enabled.value:  # no spool traces: nothing to check for
            return self.fun(*args, **kwargs)
        site = user_site()
        closed, flat, rebuild = trace_filtered(self.fun, args, kwargs)
        return rebuild(run_checked(closed, flat, site))


def check_with(fun: Callable[..., _T]) -> Callable[..., _T]:
    """`fun` with the checks of `first_nonfinite="any"` made where it is traced, inside the
    `scope` blocks around its call: `logger.jit(..., step="i")` wraps the function in its step
    before its `scope(step=i)`, so that the checks carry the call's step, as its logs do (the
    spool's own rewrite runs outside that scope). The spool around it searches them with
    `first_nonfinite=True`."""
    return build_wrapper(_Checked, fun)
