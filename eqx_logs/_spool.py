"""The public transforms: `spool` and `nolog`."""

import dataclasses
import functools
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray, PyTree

from . import _compat, _masking, _nnx  # noqa: F401  (_masking: registers batching rules)
from ._interpret import Spool, warn_unmatched
from ._logdict import LogDict
from ._primitive import current_prefix, tracing_context
from ._reduce import AbstractReduction, Policy, with_options
from ._retrace import OPEN, finish, fun_name, note_compile
from ._rules import RULES

_T = TypeVar("_T")


def spool(
    fun: Callable[..., _T] | None = None,
    /,
    *,
    policy: Any = None,
    reduce: str | AbstractReduction | None = None,
    interval: int | None = None,
    window: int | None = None,
    tags: str | tuple[str, ...] | None = None,
    exclude: str | tuple[str, ...] | None = None,
    prefix: str | None = None,
    keep: bool = False,
    key: PRNGKeyArray | None = None,
    across: str | tuple[str, ...] | None = None,
    first_nonfinite: bool | None = None,
) -> Callable[..., tuple[_T, LogDict]]:
    """Capture every [`eqx_logs.log`][] event of `fun` and return them with its output.

    **Arguments:**

    - `fun`: the function. `spool` also works as a bare decorator or with options only:
        `@eqx_logs.spool` or `@eqx_logs.spool(tags="train")`.
    - `policy`: an [`eqx_logs.Policy`][]; the keywords below override its fields.
    - `reduce`: the default reduction, a name (`"stack"`, `"mean"`, `"last"`, ...) or an
        [`eqx_logs.AbstractReduction`][] (`Stack(capacity=...)` for logs inside while loops).
    - `interval`: with `interval=k`, an event logged with a step (`log(..., step=i)`, or
        inside `scope(step=i)`) is kept where `i` is a multiple of k, whichever call it
        happens in (steps 0, k, 2k, ... of a loop calling the spooled step); an event
        without a step is numbered per key within each call (its events 0, k, 2k, ...).
    - `window`: reduce each run of `window` events and stack the results.
    - `tags`: keep only events carrying at least one of these tags (None keeps all).
    - `exclude`: drop events carrying any of these tags.
    - `prefix`: prepended to every output key.
    - `keep`: also pass the captured events on to an enclosing spool (by default an inner
        spool consumes them). Events this spool does not select always pass on.
    - `key`: a `jax.random.key` for sampling reductions.
    - `across`: manual mesh axes (`jax.shard_map`, `jax.pmap`) or named `jax.vmap` axes to
        merge the devices' (lanes') results over, with each reduction's `merge` (see
        [`eqx_logs.Policy`][]). By default a key logged inside a shard_map has one output axis per
        manual mesh axis, after the event axis.
    - `first_nonfinite`: also report the first event, in execution order, with a NaN or
        infinite element, as `logs.first_nonfinite` (see [`eqx_logs.Policy`][]).

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
    options = dict(reduce=reduce, interval=interval, window=window, tags=tags, exclude=exclude)
    options.update(prefix=prefix, key=key, across=across, first_nonfinite=first_nonfinite)
    if fun is None:
        policy = with_options(policy, "eqx_logs.spool", **options)
        return functools.partial(spool, policy=policy, keep=keep)
    return _spooled(fun, policy, keep, options)


def _spooled(fun: Callable, policy: Any, keep: bool, options: dict[str, Any]) -> "_Spooled":
    """`spool(fun, policy=policy, keep=keep, **options)`. A plain function spooled without a
    policy or a key (`spool(f)(x)` written inline in a loop) gets the same (immutable) object
    every time: cached by `_spool_of`."""
    if policy is None and options["key"] is None and isinstance(fun, types.FunctionType):
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


_W = TypeVar("_W", bound=eqx.Module)
_ABSENT = object()

# what `functools.wraps` and `eqx.module_update_wrapper` copy (Equinox's
# `WRAPPER_FIELD_NAMES`), each with the types it may have and its value where nothing has it
_WRAPPER_FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "__module__": ((str, type(None)), None),
    "__name__": ((str,), None),
    "__qualname__": ((str,), None),
    "__doc__": ((str, type(None)), None),
    "__annotations__": ((dict,), {}),
}


def without_missing(module: Any) -> Any:
    """`module` (rebuilt by `tree_unflatten`) without the wrapper fields Equinox set to its
    `Missing` sentinel: a module with a custom `__init__` that leaves a field at its class
    default is flattened with Equinox's wrapper fields, so a copy of it (`jax.tree.map`) is
    named `Missing`, and `eqx.filter_jit`, which names its computation after it, raises
    `TypeError: __name__ must be set to a string object`. Returns `module`, changed in place
    (it was just made)."""
    fields = getattr(module, "__dict__", {})
    for name, (kinds, _) in _WRAPPER_FIELDS.items():
        if name in fields and not isinstance(fields[name], kinds):
            del fields[name]
    return module


# Equinox warns when a Module field holds a JAX-transformed callable whose arrays it cannot
# see (`jax.vmap(model)`): a gradient with respect to the Module would miss them. A wrapper
# calls the callable as given, as `jax.vmap(model)` alone would: no warning for correct code.
_TRANSFORMED = r"\s*Possibly assigning a JAX-transformed callable"


def build(cls: Callable[..., _W], *fields: Any, **options: Any) -> _W:
    """`cls(*fields, **options)`, without Equinox's warning about a JAX-transformed callable
    (`spool(jax.vmap(model))`, `tap(jax.grad(f))`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TRANSFORMED, UserWarning)
        return cls(*fields, **options)


def build_wrapper(cls: Callable[..., _W], *fields: Any) -> _W:
    """`update_wrapper(cls(*fields))`, built as by `build` (both construct the Module)."""
    return build(lambda: update_wrapper(cls(*fields)))


def update_wrapper(wrapper: _W) -> _W:
    """`eqx.module_update_wrapper(wrapper)`, for every public wrapper (spool, tap, plant, the
    loggers'), with all the fields `functools.wraps` copies set, its fields the objects given
    (not copies), and marked as made here (see `rebuilt`).

    Equinox keeps a wrapper's copied fields through flattening as a whole: one it did not copy
    comes back from `tree_unflatten` as a `Missing` sentinel. A callable object (an Equinox
    model) has a `__doc__` but no `__name__`, so `eqx.filter_jit(spool(model))`, which
    unflattens `spool(model)`, was named `Missing`, and `functools.wraps` (`nolog`,
    `jax.named_call`) and `jax.jit` of it raised `TypeError: __name__ must be set to a string
    object`. Here each field is taken from the first of the wrapped function, those it wraps
    (`__wrapped__`) and the innermost one's class that has it: a model is named by its class,
    as `eqx.filter_jit` names its computation.

    `module_update_wrapper` returns a copy made by flattening, whose fields are copies too.
    A model with a custom `__init__` whose fields are not all set in its `__dict__` (a static
    field left at its class default) is flattened with Equinox's wrapper fields, so its copy
    has `__name__` set to `Missing`, and `eqx.filter_jit`, which names its computation after
    the innermost wrapped object, raised that `TypeError` again. The fields are the objects
    given: the model itself (and a Flax NNX model stays the caller's)."""
    chain = [wrapper.__wrapped__]  # pyright: ignore[reportAttributeAccessIssue]
    while len(chain) < 64 and hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    chain.append(type(chain[-1]))
    names = types.SimpleNamespace()
    for field, (kinds, default) in _WRAPPER_FIELDS.items():
        values = (getattr(f, field, _ABSENT) for f in chain)
        setattr(names, field, next((v for v in values if isinstance(v, kinds)), default))
    out = eqx.module_update_wrapper(wrapper, names)
    for field in dataclasses.fields(wrapper):
        object.__setattr__(out, field.name, getattr(wrapper, field.name))
    out.__dict__[_MADE] = True
    return out


# set on a wrapper by `update_wrapper`; a copy made by flattening (`eqx.filter_jit(spool(f))`
# rebuilds `spool(f)` inside its trace) does not have it
_MADE = "_eqx_logs_made"


def rebuilt(wrapper: eqx.Module) -> bool:
    """Whether `wrapper` was rebuilt from its leaves by a transform (not made by its
    constructor): the Flax NNX objects it is called on are then that transform's copies."""
    return _MADE not in wrapper.__dict__


def with_fun(wrapper: _W, fun: Callable) -> _W:
    """`wrapper` calling `fun` instead (a `_nnx.Merging` of its function)."""
    out = object.__new__(type(wrapper))
    out.__dict__.update(wrapper.__dict__)
    out.__dict__["fun"] = fun
    return out


def carrying(
    wrapper: Any, where: str, run: Callable, args: tuple, kwargs: dict, logs: bool = False
) -> Any:
    """`run(wrapper, args, kwargs)`, the Flax NNX objects in `wrapper.fun`, `args` and
    `kwargs` carried as `nnx.jit` carries them (see `_nnx.py`). `run` returns the function's
    output, or with `logs` a pair `(output, logs)`."""
    carry = _nnx.carry(wrapper.fun, args, kwargs)
    if carry is None:
        return run(wrapper, args, kwargs)
    result = run(with_fun(wrapper, carry.fun), carry.args, carry.kwargs)
    (out, after), rest = result if logs else (result, None)
    carry.finish(after, where, rebuilt(wrapper))
    return (out, rest) if logs else out


@functools.lru_cache(maxsize=256)  # bounded: it keeps the functions alive
def _spool_of(fun: Callable, keep: bool, options: tuple) -> "_Spooled":
    return _make(fun, None, keep, dict(options))


class _Spooled(eqx.Module):
    """`spool(fun)`: a pytree whose leaves are those of `fun` (an Equinox model's arrays) and
    of the policy, like `eqx.filter_jit(fun)`, so that it can be jitted, differentiated and
    vmapped over as the model itself."""

    fun: Callable
    policy: Policy
    keep: bool = eqx.field(static=True)

    # `jax.jit(spool(f))` hashes the function: by identity, like a closure (the fields may be
    # arrays, a model's or a logger state).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args, **kwargs):
        return carrying(self, "eqx_logs.spool", _Spooled._run, args, kwargs, logs=True)

    def __repr__(self) -> str:
        return f"eqx_logs.spool({fun_name(self.fun)})"

    def __str__(self) -> str:
        return under_jax_jit(repr(self))

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

    def __get__(self, instance, owner):  # a decorated method binds like a function
        del owner
        return self if instance is None else jtu.Partial(self, instance)


def under_jax_jit(shown: str, compiles: bool = False) -> str:
    """A wrapper's `str`: its short name, `shown`, and how it is called with arguments that
    are not arrays. `jax.jit(spool(f))(model, x)` of a model with a non-array leaf (an
    `eqx.nn.MLP`'s activation) fails in JAX before the wrapper runs, with "Error interpreting
    argument to {the wrapper's str} as an abstract array": that is this, in place of the
    wrapper's pytree, many lines of internal reprs. (`compiles`: `logger.jit`, which compiles
    the step itself.)"""
    if compiles:
        return (
            f"{shown} (logger.jit compiles the step itself, its arguments filtered as by "
            "`eqx.filter_jit`: call it directly, or under `eqx.filter_jit`, not under `jax.jit`)"
        )
    return (
        f"{shown} (its arguments are filtered as by `eqx.filter_jit`: call it directly or "
        "under `eqx.filter_jit`, not under `jax.jit`, or mark the non-array arguments static)"
    )


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
    closed, flat, rebuild = trace_filtered(fun, args, kwargs)
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
