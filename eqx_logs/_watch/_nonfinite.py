"""`first_nonfinite="any"`: the first operation whose output has a NaN or an infinity, in code
the user did not write, forward and backward, found on the device in one run.

The program is rewritten as `watch` rewrites it: the output of each operation that can turn
finite inputs into a non-finite output (a division, an `exp`, a matmul that overflows, ...)
is checked, and the checks of each straight run of operations are one event under
`CHECKED`: 0 if every output is finite, NaN if not, with the index of the first that is not
as its step `OPERATION`, logged at a site that lists the run's operations (each with its
address and the user's line), tagged `CHECK_TAG`: the search's own, which a policy that
searches keeps whatever its filters say, and no logger writes. The spool's
`first_nonfinite` search, which looks at every event in execution order, then reports the
first of them (with the loop iterations, the vmap lane and the pass). Under a vmap inside
the spool, each operation its batching rule bracketed (`_lanes.py`) is checked per lane,
its checks one event per lane (under `lanes_key`). Inside a shard_map each device checks
its own operations, under a key of their own (`checked_key`: a key is logged under one set
of mesh axes), and the search names the device. An operation that only moves or selects
values (`reshape`, `select_n`, `max`, `tanh`, ...), or scales them by a literal of at most 1
(`0.5 * x`), cannot make a non-finite value of finite ones, so its output is not checked:
where it is not finite, an input was, and that was checked first (or is an input of the
program, checked on entry).
"""

import contextlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from .._primitive import BACKWARD_TAG, bind
from .._scope import marking, user_site
from .._wrapper import AbstractWrapper, build_wrapper, carrying
from ._lanes import begin_p, end_p, install, is_bracket
from ._rewrite import LOOPS, Watcher, retraced
from ._spec import CHECK_TAG, OPERATION, Watch, checked_key, lanes_key

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
        # (value, site, operation, backward pass, NaN only, its lanes' axes, their sizes)
        self.pending: list[tuple[Any, str, str, bool, bool, tuple, tuple]] = []
        # the operations a batching rule bracketed (`_lanes.py`) open now, innermost last:
        # `(number, what it logged)`, each `(value, site, operation, backward pass, NaN
        # only, primitive)`, or a bracket ended inside, `("lanes", outputs, its end's
        # params, what it logged)`: checked where the outermost ends, per lane
        self.frames: list[tuple[int, list[tuple]]] = []
        self.sentinels: dict[int, tuple[Any, str]] = {}  # id -> (value, "inf" | "nan")
        # how the equation being evaluated is checked: "all", "nan" (only) or None (not)
        self.check: str | None = "all"
        self.mesh: tuple[str, ...] = ()  # the manual mesh axes of the shard_maps around it

    def contains(self, closed: Any) -> bool:
        # (what holds brackets is evaluated here, and they are removed)
        return _compat.any_eqn(closed, lambda e: self.watches(e) or is_bracket(e))

    def equation(self, eqn, invals: list[Any], path: str, outer: tuple, counters) -> list[Any]:
        if eqn.primitive is begin_p:
            self.frames.append((eqn.params["id"], []))
            return []
        if eqn.primitive is end_p:
            self._ended(eqn, invals)
            return []
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
            nan_only = self.check == "nan"
            if self.frames:  # (a batching rule's: checked per lane where it ends)
                entry = (x, site, operation, backward, nan_only, eqn.primitive.name)
                self.frames[-1][1].append(entry)
            else:
                self.gather(x, site, operation, backward, nan_only)
        return x

    def _ended(self, eqn: _compat.JaxprEqn, invals: list[Any]) -> None:
        """The end of an operation a batching rule bracketed: its outputs (`invals`, batched
        on `eqn.params["axes"]`) checked per lane (`_lane_checks`).

        Inside another bracket it waits: a vmap around (nested, or batching a jaxpr that
        holds this one) brackets the same operation, and its end, which knows all the lanes,
        checks it instead; a bracket whose end is not here (partial evaluation put it with
        the tangents) checks what it holds, this one included, where it is released (at the
        next `flush`). An end whose begin is not here checks nothing: what was logged
        meanwhile is checked as it is."""
        ids = [f[0] for f in self.frames]
        if eqn.params["id"] not in ids:
            return
        at = ids.index(eqn.params["id"])
        logged = [e for _, inner in self.frames[at:] for e in inner]  # (begun inside: too)
        del self.frames[at:]
        logged = [x for e in logged for x in (e[3] if e[0] == "lanes" else [e])]  # superseded
        if self.frames:
            self.frames[-1][1].append(("lanes", invals, eqn.params, logged))
        else:
            self._lane_checks(invals, eqn.params, logged)

    def _lane_checks(self, outs: list[Any], params: dict, logged: list[tuple]) -> None:
        """A bracketed operation's outputs `outs`, batched on `params["axes"]`, checked per
        lane as the output of the operation its rule made (the last logged of its primitive's,
        else the last logged); then what else it logged (a derivative's factor the rule
        computed beside), as it is."""
        main = [p for p in logged if p[5] == params["name"]]
        rest = [p for p in logged if p[5] != params["name"]] if main else []
        if logged:
            _, site, operation, backward, nan_only, _ = (main or logged)[-1]
            for x, axes in zip(outs, params["axes"]):
                kind = self.sentinels.get(id(x), (None, None))[1]
                if kind != "nan":
                    self.gather(x, site, operation, backward, nan_only or kind == "inf", axes)
        for entry in rest:
            self.gather(*entry[:5])

    def _release(self) -> None:
        """What the open brackets hold, checked (in order)."""
        frames, self.frames = self.frames, []
        for _, logged in frames:
            for entry in logged:
                if entry[0] == "lanes":
                    self._lane_checks(*entry[1:])
                else:
                    self.gather(*entry[:5])

    def gather(
        self,
        x: Any,
        site: str,
        operation: str,
        backward: bool,
        nan_only: bool = False,
        axes: tuple[int, ...] = (),
    ) -> None:
        lanes = tuple(jnp.shape(x)[a] for a in axes)
        if self.pending and self.pending[-1][3:7:3] != (backward, lanes):
            self.flush()  # (one pass per event, of one lane shape)
        self.pending.append((x, site, operation, backward, nan_only, axes, lanes))

    def flush(self) -> None:
        if self.frames:
            self._release()
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        lanes = pending[0][6]
        if lanes:  # each lane's largest magnitude (`_largest` of all lanes at once, else)
            largest = [_lane_largest(p[0], p[5], math.prod(lanes)) for p in pending]
        else:
            largest = _largest([p[0] for p in pending])
        finite = jnp.stack(
            [~jnp.isnan(m) if p[4] else jnp.isfinite(m) for m, p in zip(largest, pending)]
        )
        table = json.dumps([[p[1], p[2]] for p in pending])
        tags = (CHECK_TAG, BACKWARD_TAG) if pending[0][3] else (CHECK_TAG,)
        key = checked_key(self.mesh)

        def event(finite):
            value = lax.select(jnp.all(finite), jnp.float32(0), jnp.float32(np.nan))
            first = jnp.argmin(finite).astype(jnp.int32)  # (the first False)
            bind({key: value}, {OPERATION: first}, tags=tags, site=table, reduce="count")
            return ()

        if lanes:  # an event per lane (a key per number of lanes: a key has one layout)
            key = lanes_key(key, math.prod(lanes))
            jax.vmap(event, in_axes=1)(finite)
        else:
            event(finite)


def _lane_largest(x: Any, axes: tuple[int, ...], n: int) -> Any:
    """The largest magnitude in each of the `n` lanes of `x`, batched on `axes`."""
    m = jnp.moveaxis(_magnitude(x), axes, tuple(range(len(axes)))).reshape(n, -1)
    return jnp.max(m, axis=1) if m.shape[1] else jnp.zeros((n,), m.dtype)


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
        with bracketing_lanes("any"):
            closed, flat, rebuild = trace_filtered(self.fun, args, kwargs)
        return rebuild(run_checked(closed, flat, site))


def bracketing_lanes(first_nonfinite: Any) -> Any:
    """Around the trace of a function whose program `checked` checks (`first_nonfinite` is
    `"any"`): the batching rules bracket what they emit, so that each check under a vmap
    inside knows its lanes (`_lanes.py`); else nothing."""
    if first_nonfinite != "any":
        return contextlib.nullcontext()
    install()
    return marking()


def check_with(fun: Callable[..., _T]) -> Callable[..., _T]:
    """`fun` with the checks of `first_nonfinite="any"` made where it is traced, inside the
    `scope` blocks around its call: `logger.jit(..., step="i")` wraps the function in its step
    before its `scope(step=i)`, so that the checks carry the call's step, as its logs do (the
    spool's own rewrite runs outside that scope). The spool around it searches them with
    `first_nonfinite=True`."""
    return build_wrapper(_Checked, fun)
