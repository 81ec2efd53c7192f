"""The public transforms: `spool` and `nolog`."""

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Unpack

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from . import _compat, _masking, _nnx  # noqa: F401  (_masking: registers batching rules)
from ._interpret import Spool, warn_unmatched
from ._logdict import LogDict
from ._primitive import current_prefix, tracing_context
from ._reduce import Policy, PolicyOptions, check_options, document_options, with_options
from ._retrace import OPEN, finish, note_compile
from ._rules import RULES
from ._watch._nonfinite import bracketing_lanes, checked
from ._watch._rewrite import watched
from ._wrapper import AbstractWrapper, build_wrapper, carrying

_T = TypeVar("_T")


@document_options
def spool(
    fun: Callable[..., _T] | None = None,
    /,
    *,
    policy: Policy | None = None,
    keep: bool = False,
    **options: Unpack[PolicyOptions],
) -> Callable[..., tuple[_T, LogDict]]:
    """Capture every [`eqx_logs.log`][] event of `fun` and return them with its output.

    **Arguments:**

    - `fun`: the function. `spool` also works as a bare decorator or with options only:
        `@eqx_logs.spool` or `@eqx_logs.spool(tags="train")`.
    - `policy`: an [`eqx_logs.Policy`][]; the options below override its fields (an option
        left out, or None, keeps the policy's).
    - `keep`: also pass the captured events on to an enclosing spool (by default an inner
        spool consumes them). Events this spool does not select always pass on.

    The policy's options, as for [`eqx_logs.Policy`][]:

    {policy_options}

    **Returns:**

    A function with the signature of `fun` returning `(out, logs)`, where `logs` is a
    [`eqx_logs.LogDict`][]: `logs[key]` stacks the key's events along a new leading axis in
    execution order, `logs.count[key]` is the number of real events.

    Arguments are filtered as by `eqx.filter_jit`: arrays are traced, everything else is
    static. Called eagerly, the spooled function is compiled and cached per static arguments
    and input shapes; called on traced arguments (inside `jax.jit`, `jax.grad`, `jax.vmap`),
    it is evaluated in that trace.

    !!! example

        ```python
        def f(xs):
            def step(c, x):
                eqx_logs.log("c", c)
                return c + x, None
            return jax.lax.scan(step, 0.0, xs)[0]

        out, logs = eqx_logs.spool(f)(jnp.arange(3.0))  # logs["c"] == [0., 0., 1.]
        ```
    """
    if options:
        check_options("eqx_logs.spool", options, also=("policy", "keep"))
    if fun is None:
        policy = with_options(policy, "eqx_logs.spool", **options)
        return functools.partial(spool, policy=policy, keep=keep)
    return _spooled(fun, policy, keep, options)


def _spooled(fun: Callable, policy: Any, keep: bool, options: dict[str, Any]) -> "_Spooled":
    """`spool(fun, policy=policy, keep=keep, **options)`. A plain function spooled without a
    policy or a key (`spool(f)(x)` written inline in a loop) gets the same (immutable) object
    every time: cached by `_spool_of`."""
    if policy is None and options.get("key") is None and isinstance(fun, types.FunctionType):
        try:
            return _spool_of(fun, keep, tuple(options.items()))
        except TypeError:  # an option that is not hashable (or a bad one: raised below)
            pass
    return _make(fun, policy, keep, options)


def _make(fun: Callable, policy: Any, keep: bool, options: dict[str, Any]) -> "_Spooled":
    policy = with_options(policy, "eqx_logs.spool", **options)
    if not callable(fun):
        raise TypeError(f"eqx_logs.spool expects a callable, got {type(fun).__name__}.")
    return build_wrapper(_Spooled, fun, policy, keep)


@functools.lru_cache(maxsize=256)  # bounded: it keeps the functions alive
def _spool_of(fun: Callable, keep: bool, options: tuple) -> "_Spooled":
    return _make(fun, None, keep, dict(options))


class _Spooled(AbstractWrapper):
    """`spool(fun)`: a pytree whose leaves are those of `fun` (an Equinox model's arrays) and
    of the policy (see `AbstractWrapper`)."""

    fun: Callable
    policy: Policy
    keep: bool = eqx.field(static=True)

    shown: ClassVar[str] = "eqx_logs.spool"

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args, **kwargs):
        return carrying(self, "eqx_logs.spool", _Spooled._run, args, kwargs, logs=True)

    def _run(self, args: tuple, kwargs: dict) -> tuple[Any, LogDict]:
        if _compat.is_traced((args, kwargs)):
            # inside jit, grad or vmap: evaluated in that trace, as the code around it is (a
            # nested jit would be traced, then differentiated or batched, again)
            return _spool_run(self.fun, self.policy, self.keep, args, kwargs)
        # The enclosing scope changes the keys `fun` logs, so it is part of the cache key.
        static, arrays = _split(self)
        parts = (static, current_prefix(), arrays)
        try:
            out, children, layout = _spool_call(parts, args, kwargs)
        finally:
            if OPEN:  # (a compilation of a Python scalar's value: timed, maybe said)
                finish()
        return out, LogDict.tree_unflatten(layout.value, children)


def trace_filtered(fun, args, kwargs) -> tuple[Any, list[Any], Callable[[list[Any]], Any]]:
    """Trace `fun(*args, **kwargs)` with logging on, filtered like `eqx.filter_jit` (arrays are
    inputs, everything else is static). Returns the jaxpr, its inputs, and a function that
    rebuilds `fun`'s output from the jaxpr's outputs."""
    dynamic, static = eqx.partition((fun, args, kwargs), eqx.is_array)
    flat, treedef = jtu.tree_flatten(dynamic)
    out_structure = []

    def flat_fun(*flat_args):
        f, a, k = eqx.combine(jtu.tree_unflatten(treedef, flat_args), static)
        out_dynamic, out_static = eqx.partition(f(*a, **k), eqx.is_array)
        leaves, out_def = jtu.tree_flatten(out_dynamic)
        out_structure.append((out_def, out_static))
        return leaves

    with tracing_context(enabled=True):
        closed = jax.make_jaxpr(flat_fun)(*flat)

    def rebuild(outs):
        out_def, out_static = out_structure[-1]
        return eqx.combine(jtu.tree_unflatten(out_def, outs), out_static)

    return closed, flat, rebuild


def _spool_run(fun: Callable, policy: Policy, keep: bool, args, kwargs):
    with bracketing_lanes(policy.first_nonfinite):  # (`"any"`: the lanes of a vmap inside)
        closed, flat, rebuild = trace_filtered(fun, args, kwargs)
    if policy.watch is not None:
        closed = watched(closed, flat, policy.watch, "eqx_logs.spool")
    if policy.first_nonfinite == "any":
        closed = checked(closed, flat)
    spool = Spool(policy, RULES, keep=keep)
    outs, logs = spool.run(closed, flat)
    warn_unmatched(spool.interp.plan, "eqx_logs.spool", spool.store)
    return rebuild(outs), logs


class _Static:
    """A static value for Equinox, not a pytree, hashed once and compared by identity first:
    the static part of a spooled function, or the structure of the LogDict it returns."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Any):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and (
            self.value is other.value or self.value == other.value
        )


# `_Spooled` -> its static part and its arrays, split once per object: an eager call then
# passes `eqx.filter_jit` one static leaf and a list of arrays instead of the function's and
# policy's pytrees.
_SPLITS: "weakref.WeakKeyDictionary[_Spooled, tuple[_Static, list[Any]]]" = (
    weakref.WeakKeyDictionary()
)


def _split(spooled: "_Spooled") -> tuple[_Static, list[Any]]:
    hit = _SPLITS.get(spooled)
    if hit is None:
        # as `eqx.filter_jit` splits its arguments: arrays traced, the rest hashed (None marks
        # an array's place: None is no leaf)
        leaves, treedef = jtu.tree_flatten((spooled.fun, spooled.policy))
        arrays = [x for x in leaves if eqx.is_array(x)]
        static = tuple(None if eqx.is_array(x) else x for x in leaves)
        hit = _SPLITS[spooled] = (_Static((static, treedef, spooled.keep)), arrays)
    return hit


@eqx.filter_jit
def _spool_call(parts, args, kwargs):  # few parameters: eqx binds them per call
    static, _, arrays = parts  # the scope (the middle part) is in the cache key only
    leaves, treedef, keep = static.value
    arrays = iter(arrays)
    leaves = [next(arrays) if x is None else x for x in leaves]
    fun, policy = jtu.tree_unflatten(treedef, leaves)
    note_compile("eqx_logs.spool", static, fun, args, kwargs)
    out, logs = _spool_run(fun, policy, keep, args, kwargs)
    # the LogDict leaves as a list, its structure static: Equinox splits and rebuilds a
    # list faster than a LogDict, and the caller rebuilds that once
    children, layout = logs.tree_flatten()
    return out, children, _Static(layout)


def nolog(fun: Callable[..., _T]) -> Callable[..., _T]:
    """`fun` with every [`eqx_logs.log`][] inside it removed.

    **Arguments:**

    - `fun`: any function, jitted or not.

    **Returns:**

    A function with the same signature and outputs. Nothing is logged from inside it, even
    under an enclosing `spool`, and it compiles to exactly what `fun` would without logs.
    """

    @functools.wraps(fun)
    def wrapper(*args: PyTree, **kwargs: PyTree) -> _T:
        with tracing_context(enabled=False):
            return fun(*args, **kwargs)

    return wrapper
