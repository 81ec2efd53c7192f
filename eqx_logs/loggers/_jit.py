"""`logger.jit`'s dispatch: `eqx.filter_jit`'s split of the arguments, without its wait.

`eqx.filter_jit` waits, at every call, for the device to finish the call's computation (it
blocks on a marker output, so that an `eqx.error_if` raises at the call). A training loop
that calls one compiled step per iteration then never dispatches a step while the device
runs the one before, and pays Equinox's Python work for every call on top. `Jit` splits the
function's and the arguments' leaves as `eqx.filter_jit` does (arrays traced, every other
leaf compiled in, a new one compiling anew) and calls a `jax.jit` of the arrays alone, which
returns as soon as the computation is dispatched.

Flax NNX objects among the arguments are carried out of each call as `nnx.jit` carries them
(`_nnx.py`): those passed as arguments themselves per structure (`Jit._fast_call`), others by
a split at each call (`Jit._carried`); the compiled step of each graph is made once
(`Jit._graph`).
"""

import inspect
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import compress
from typing import Any, Literal

import equinox as eqx
import jax
import jax.tree_util as jtu

from .. import _nnx
from .._retrace import OPEN, finish
from ._steps import StepArg

Donate = Literal["all", "all-except-first", "warn", "none"]


class _Static:
    """A pytree without leaves: what a trace found in the output that is not an array. (Its
    unflattening must return a `_Static`: `jax.jit`'s fast path, in C++, is left for a
    slower one, ten times slower, where it returns another object.)"""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


jtu.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: _Static(value))


# leaf types -> (which are arrays, which are not): whether a leaf is an array depends on its
# type alone, so `_split` works it out once per tuple of types
_ARRAYS: dict[tuple[type, ...], tuple[tuple[bool, ...], tuple[bool, ...]]] = {}


def _split(leaves: Sequence[Any]) -> tuple[tuple[tuple[bool, ...], tuple[Any, ...]], list]:
    """Which leaves are arrays and the others' values (what a compiled step is looked up
    by), and the arrays."""
    types = tuple(map(type, leaves))
    try:
        arrays, others = _ARRAYS[types]
    except KeyError:
        arrays = tuple(map(eqx.is_array, leaves))
        others = tuple(not a for a in arrays)
        if len(_ARRAYS) > 1024:  # (types that come and go)
            _ARRAYS.clear()
        _ARRAYS[types] = arrays, others
    return (arrays, tuple(compress(leaves, others))), list(compress(leaves, arrays))


def _merge(arrays: tuple[bool, ...], others: tuple[Any, ...], values: Sequence[Any]) -> list:
    values, others = iter(values), iter(others)
    return [next(values) if a else next(others) for a in arrays]


# (`fun`'s static part, donate) -> (the arguments' static part -> `jax.jit` of the arrays),
# for the functions used last: equal functions share their compiled steps, as in
# `eqx.filter_jit` (a `logger.jit` made again for each epoch compiles once).
_COMPILED: "OrderedDict[Any, dict[Any, Any]]" = OrderedDict()
_KEEP = 64


def _compiled(key: Any) -> dict[Any, Any]:
    try:
        _COMPILED.move_to_end(key)
    except TypeError:  # a leaf of the function neither an array nor hashable: its own
        return {}
    except KeyError:
        _COMPILED[key] = {}
        if len(_COMPILED) > _KEEP:
            _COMPILED.popitem(last=False)
    return _COMPILED[key]


_CARRIED = object()  # in place of a compiled step: the arguments hold Flax NNX objects
_NOT_FAST = object()  # what `Jit._fast_call` returns for a call it leaves to the others


class _Nested(Exception):
    """Raised by the compiled step of `Jit._fast_call` for arguments that hold NNX objects
    inside them: the call is carried whole by `Jit._carried` (one graph of every object)."""


# The treedef of `(args, {})` for the treedefs of the arguments (`Jit._flatten`).
_ARGS_DEFS: dict[tuple[Any, ...], Any] = {}
_NO_KWARGS = jtu.tree_structure({})
# An output's treedef -> the parts of the output `Jit._flatten` may take the leaves of (`_parts`)
_PARTS: dict[Any, tuple[tuple[tuple[int, ...], Any, int, int], ...]] = {}


def _immutable(treedef: Any) -> bool:
    """Whether every node of `treedef` is a tuple (a named tuple too), None or an Equinox
    module: nothing in such a tree can be changed in place."""
    pending = [treedef]
    while pending:
        node = pending.pop()
        data = node.node_data()
        if data is not None and not issubclass(data[0], (tuple, type(None), eqx.Module)):
            return False
        pending.extend(node.children())
    return True


def _parts(out_def: Any, path: tuple[int, ...] = (), start: int = 0) -> list:
    """The parts of an output of this treedef that `Jit._flatten` may take the leaves of:
    `(path, treedef, first leaf, end)` for each immutable element inside plain tuples (the
    step's `(model, opt_state, loss)`, inside `(out, logs)`)."""
    parts = []
    for i, child in enumerate(out_def.children()):
        end = start + child.num_leaves
        if child.num_nodes > 1 and _immutable(child):  # (a bare leaf gains nothing)
            parts.append(((*path, i), child, start, end))
        data = child.node_data()
        if data is not None and data[0] is tuple:  # (and its elements, passed one by one)
            parts += _parts(child, (*path, i), start)
        start = end
    return parts


class Last:
    """The parts of the last output of the `Jit`s that share it (see `Jit._flatten`): the
    kept and the skipped steps' programs of a `logger.jit` share one, so that only the
    latest output is held, which the caller holds too (each holding its own would keep an
    older copy of the model alive)."""

    __slots__ = ("parts",)

    def __init__(self):
        # id -> (part, its treedef, its leaves)
        self.parts: dict[int, tuple[Any, Any, list]] = {}


def _at(out: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        out = out[i]
    return out


class Jit:
    """`fun` compiled as by `eqx.filter_jit(fun, donate=donate)`, called without waiting
    for the device. (`fun`'s own arrays are passed to each call, never donated.)"""

    def __init__(
        self,
        fun: Callable,
        donate: Donate = "none",
        *,
        first: int = 1,
        step: StepArg | None = None,
        last: Last | None = None,
    ):
        if donate not in ("all", "all-except-first", "warn", "none"):
            raise ValueError(
                f"logger.jit(donate={donate!r}): one of 'all', 'all-except-first', 'warn', "
                "'none' (as for `eqx.filter_jit`)."
            )
        self.fun, self.donate, self._first = fun, donate, first
        # the step argument (`logger.jit(..., step=...)`): passed traced whatever it is (a
        # Python int too: a new step compiles nothing), after the other arrays
        self._step = step
        self._last = Last() if last is None else last  # (see `_flatten`)
        leaves, self._fun_def = jtu.tree_flatten(fun)
        self._fun_split, self._fun_arrays = _split(leaves)
        self._compiled = _compiled((self._fun_def, self._fun_split, donate))
        # a Flax NNX model changes in place: carried out of each call as `nnx.jit` does
        self._carries = _nnx.has_variables(fun)
        # NNX objects passed as arguments, per structure (see `_nnx.Fast`); the compiled
        # steps of the objects' graphs, for `_fast` and `_carried`
        self._fast = _nnx.Fast()
        self._graphs: OrderedDict[Any, Jit] = OrderedDict()
        self._inner = False  # (the step of `_fast`: called on arguments without NNX objects)
        try:  # to bind arguments as `eqx.filter_jit` does
            self._signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):  # (a callable without one: arguments as given)
            self._signature = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._carries and not self._inner and _nnx.flax_imported():
            out = self._fast_call(args, kwargs)
            if out is not _NOT_FAST:
                return out
        jitted, arrays = self._prepare(args, kwargs)
        if jitted is _CARRIED:
            if self._inner:
                raise _Nested
            return self._carried(args, kwargs, "__call__")
        try:
            if self.donate in ("all", "all-except-first"):  # as Equinox: no warning for these
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                    values, out = jitted(*self._fun_arrays, *arrays)
            else:
                values, out = jitted(*self._fun_arrays, *arrays)
        finally:
            if OPEN:  # (a compilation of a Python scalar's value: timed, maybe said)
                finish()
        treedef, split = out.value
        leaves = _merge(*split, values)
        out = jtu.tree_unflatten(treedef, leaves)
        self._keep(out, treedef, leaves)
        return out

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The `jax.stages.Lowered` of a call with these arguments."""
        jitted, arrays = self._prepare(args, kwargs)
        if jitted is _CARRIED:
            return self._carried(args, kwargs, "lower")
        try:
            return jitted.lower(*self._fun_arrays, *arrays)
        finally:
            if OPEN:
                finish()

    def _fast_call(self, args: tuple, kwargs: dict) -> Any:
        """A call whose arguments are Flax NNX objects themselves (`step(model, optimizer,
        x, y, i)`), carried per structure (`_nnx.Fast`): the objects' arrays read, passed
        to the compiled step of their graph, and its new ones written into their Variables,
        as `nnx.jit` leaves them. `_NOT_FAST` where no argument is an NNX object; the
        others (an NNX object inside another argument too, or one of a kind `Fast` leaves to
        `carry`) are `_carried`."""
        is_nnx = _nnx.is_nnx
        if not any(map(is_nnx, args)) and not any(map(is_nnx, kwargs.values())):
            return _NOT_FAST
        if kwargs:
            args, kwargs = self._bind(args, kwargs)
            if any(map(is_nnx, kwargs.values())):
                return self._carried(args, kwargs, "__call__")
        split = self._fast.split(args)
        if split is None:  # (objects of a kind `Fast` leaves to `carry`)
            return self._carried(args, kwargs, "__call__")
        structure, leaves, holed, targets = split
        jitted = structure.jit
        if jitted is None:
            jitted = structure.jit = self._graph(_nnx.Flat(self.fun, structure.graphdef))
        try:
            out, written = jitted(leaves, *holed, **kwargs)
        except _Nested:  # (an NNX object inside another argument: all carried together)
            return self._carried(args, kwargs, "__call__")
        donated = self.donate in ("all", "warn")
        self._fast.write(structure, targets, written, "logger.jit", donated)
        return out

    def _graph(self, fun: Any) -> "Jit":
        """The compiled step of `fun` (an `_nnx.Flat` or `_nnx.Merging` of this step's
        function on the graph of its NNX objects), made once per graph: the arrays of the
        objects come first (`all-except-first` keeps them and the first argument)."""
        key = (type(fun), fun.graphdef)
        try:
            jitted = self._graphs.get(key)
        except TypeError:  # (a graph that cannot be hashed: its own)
            key, jitted = None, None
        if jitted is None:  # (`fun` is this step's function with holes: the same for a graph)
            step = None if self._step is None else self._step.shifted(1)
            jitted = Jit(fun, self.donate, first=2, step=step)
            jitted._inner = isinstance(fun, _nnx.Flat)
            if key is not None:
                self._graphs[key] = jitted
                if len(self._graphs) > 8:
                    self._graphs.popitem(last=False)
        return jitted

    def _carried(self, args: tuple, kwargs: dict, method: str) -> Any:
        """A call on Flax NNX objects: split out, merged inside, and their new state written
        back, as `nnx.jit` does (see `_nnx.py`); their arrays are donated with
        `donate="all"` alone."""
        if kwargs:
            args, kwargs = self._bind(args, kwargs)
        carry = _nnx.carry(self.fun, args, kwargs)
        assert carry is not None
        jitted = self._graph(carry.fun)
        if method == "lower":
            return jitted.lower(*carry.args, **carry.kwargs)
        out, after = jitted(*carry.args, **carry.kwargs)
        carry.finish(after, "logger.jit", rebuilt=False, donated=self.donate in ("all", "warn"))
        return out

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[Any, list]:
        if self._carries:
            return _CARRIED, []
        if kwargs:  # as `eqx.filter_jit`: `f(x=1)` is `f(1)`; `donate`'s first: `f`'s first
            args, kwargs = self._bind(args, kwargs)
        if self._step is not None:
            step, args, kwargs = self._step.take(args, kwargs, "logger.jit")
        leaves, treedef = self._flatten(args, kwargs)
        split, arrays = _split(leaves)
        if self._step is not None:
            arrays.append(step)
        key = (treedef, split)
        try:
            jitted = self._compiled.get(key)
        except TypeError:  # a leaf neither an array nor hashable
            raise TypeError(_unhashable(args, kwargs)) from None
        if jitted is None:
            if _nnx.holds_nodes(treedef):
                jitted = _CARRIED
            else:
                jitted = self._compile(treedef, split, args)
            self._compiled[key] = jitted
        return jitted, arrays

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[list, Any]:
        """`jtu.tree_flatten((args, kwargs))`, where an argument that is a part of the last
        call's output (the model and optimiser state a training loop passes back) takes the
        leaves that output was built from rather than being flattened again: an Equinox
        module is flattened in Python, a field at a time, which costs a per-step loop more
        than the rest of the call. Only parts made of immutable nodes (tuples, named tuples,
        Equinox modules) are kept, by identity, so their leaves cannot have changed."""
        reuse = self._last.parts
        if kwargs or not reuse:
            return jtu.tree_flatten((args, kwargs))
        leaves: list = []
        defs = []
        for arg in args:
            hit = reuse.get(id(arg))
            if hit is not None and hit[0] is arg:
                defs.append(hit[1])
                leaves += hit[2]
            else:
                part, treedef = jtu.tree_flatten(arg)
                defs.append(treedef)
                leaves += part
        defs = tuple(defs)
        treedef = _ARGS_DEFS.get(defs)
        if treedef is None:
            if len(_ARGS_DEFS) > 1024:
                _ARGS_DEFS.clear()
            treedef = _ARGS_DEFS[defs] = jtu.treedef_tuple([jtu.treedef_tuple(defs), _NO_KWARGS])
        return leaves, treedef

    def _keep(self, out: Any, out_def: Any, leaves: list) -> None:
        """Keep the immutable parts of a call's output, with their leaves (see `_flatten`)."""
        parts = _PARTS.get(out_def)
        if parts is None:
            data = out_def.node_data()
            parts = tuple(_parts(out_def)) if data is not None and data[0] is tuple else ()
            if len(_PARTS) > 1024:
                _PARTS.clear()
            _PARTS[out_def] = parts
        if parts:
            reuse = {}
            for path, treedef, a, b in parts:
                part = _at(out, path)
                reuse[id(part)] = (part, treedef, leaves[a:b])
            self._last.parts = reuse

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._signature is None:
            return args, kwargs
        bound = self._signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs

    def _compile(self, treedef: Any, split: tuple, args: tuple) -> Any:
        fun_def, fun_split = self._fun_def, self._fun_split
        n_fun = len(self._fun_arrays)

        step = self._step

        def call(*arrays):
            fun = jtu.tree_unflatten(fun_def, _merge(*fun_split, arrays[:n_fun]))
            if step is None:
                args, kwargs = jtu.tree_unflatten(treedef, _merge(*split, arrays[n_fun:]))
            else:
                args, kwargs = jtu.tree_unflatten(treedef, _merge(*split, arrays[n_fun:-1]))
                args, kwargs = step.put(args, kwargs, arrays[-1])
            leaves, out_def = jtu.tree_flatten(fun(*args, **kwargs))
            out_split, values = _split(leaves)
            return values, _Static((out_def, out_split))

        name = getattr(self.fun, "__name__", None)  # (an Equinox copy's may be `Missing`)
        call.__name__ = call.__qualname__ = (
            name if isinstance(name, str) else type(self.fun).__name__
        )
        n_args = sum(split[0])
        if self.donate == "none":
            donated = ()
        else:
            first = sum(eqx.is_array(x) for x in jtu.tree_leaves(args[: self._first]))
            skip = first if self.donate == "all-except-first" else 0
            donated = tuple(range(n_fun + skip, n_fun + n_args))
        return jax.jit(call, donate_argnums=donated)


def _unhashable(args: tuple, kwargs: dict) -> str:
    for path, leaf in jtu.tree_flatten_with_path((args, kwargs))[0]:
        if eqx.is_array(leaf):
            continue
        try:
            hash(leaf)
        except TypeError:
            where = ("args" if path[0].idx == 0 else "kwargs") + jtu.keystr(path[1:])
            break
    else:  # (a pytree node's static data)
        where, leaf = "", None
    return (
        f"logger.jit: the argument{f' at {where}' if where else ''}, a "
        f"{type(leaf).__name__}, is not an array, so it is compiled into the step as a "
        "constant, as `eqx.filter_jit` does; but it cannot be hashed, so the compiled step "
        "cannot be looked up for it. Pass it as an array, or as a hashable value (a tuple "
        "rather than a list, a frozen dataclass)."
    )
