"""What every function wrapper shares (`spool(f)`, `tap(f)`, `plant(f, values)`, a logger's
`spool`, `tap` and `jit`): `AbstractWrapper`, their construction (`build_wrapper`:
`functools.wraps`'s fields, no warning for a transformed callable) and the carrying of Flax
NNX objects through a call (`carrying`)."""

import dataclasses
import types
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from . import _nnx
from ._retrace import fun_name


class AbstractWrapper(eqx.Module):
    """A function wrapper: a pytree of the function and its options (an Equinox model's
    arrays are its leaves), like `eqx.filter_jit(fun)`, so that it can be jitted,
    differentiated and vmapped over as the model itself.

    Subclasses say what they wrap (`__wrapped__`) and how they show (`shown`: the transform's
    name, `"eqx_logs.spool"`, or a logger's method, `"spool"`, shown after the logger's class
    name). `jax.jit(spool(f))` hashes the wrapper: by identity, as a closure is (its fields may
    be arrays, a model's or a logger state). A decorated method binds like a function.
    """

    shown: ClassVar[str]
    compiles: ClassVar[bool] = False  # (`logger.jit`: see `under_jax_jit`)

    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @property
    def __wrapped__(self) -> Callable:
        raise NotImplementedError

    def _name(self) -> str:
        logger = getattr(self, "logger", None)
        return self.shown if logger is None else f"{type(logger).__name__}.{self.shown}"

    def __repr__(self) -> str:
        return f"{self._name()}({fun_name(self.__wrapped__)})"

    def __str__(self) -> str:  # (see `under_jax_jit`)
        return under_jax_jit(repr(self), compiles=self.compiles)

    def __get__(self, instance, owner):
        del owner
        return self if instance is None else jtu.Partial(self, instance)


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
