"""`instrument`: statistics of every submodule's output (and its cotangent), logged without
editing the model."""

import dataclasses
import functools
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from . import _compat, _nnx
from ._primitive import bind, call_site, current_prefix, grad_tap, plant_point
from ._stats import DEFAULT_STATS, CotangentStats, check_stats, leaf_statistics, path_name
from ._wrapper import update_wrapper, without_missing

_M = TypeVar("_M")

INSTRUMENT_TAG = "instrument"  # on every event `instrument` logs


def _is_state_pair(out: Any) -> bool:
    """`(y, state)`, as a stateful layer (`eqx.nn.BatchNorm`, `eqx.nn.StateIndex` users)
    returns: the state is not an activation."""
    return isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State)


@dataclasses.dataclass(frozen=True)
class _Options:
    """What one instrumented submodule logs (a static field of it)."""

    path: str
    stats: tuple[str, ...]
    grads: bool
    per_example: bool = False  # (an `eqx.nn.Linear`: its weight gradient's norm per example)

    def example_norms(self, x: Any, out: Any) -> Any:
        """`out`, the output of a Linear called on `x`, with the per-example norm of its
        weight gradient logged in the backward pass (`_per_example.per_example_tap`)."""
        from ._per_example import per_example_tap

        prefix = current_prefix()
        name = f"{prefix}/{self.path}" if prefix else self.path
        return per_example_tap(
            f"{name}/grad/per_example_norm", call_site(), x, out, (INSTRUMENT_TAG,)
        )

    def log(self, out: Any) -> Any:
        """Log the statistics of a call's output `out`; returns `out` (with, if `grads`, the
        backward-pass statistics attached to it). While a plant traces, `out` is sown under
        the path first (`plant_point`): what the plant makes of it is returned and logged."""
        if not _compat.logging_enabled.value:
            return out  # outside a spool or tap: exactly the module's program
        site = call_site()
        prefix = current_prefix()
        name = f"{prefix}/{self.path}" if prefix else self.path
        pair = _is_state_pair(out)
        y = plant_point(name, out[0] if pair else out, site)
        items = leaf_statistics(name, y, self.stats, site)
        if items:
            bind(items, {}, tags=(INSTRUMENT_TAG,), site=site, statistics=True)
            if self.grads:
                cotangents = CotangentStats(f"{name}/grad", self.stats, site)
                y = grad_tap(cotangents, site, y, tags=(INSTRUMENT_TAG,))
        return (y, out[1]) if pair else y


_FIELD = "_eqx_logs_instrument"  # the static field an instrumented submodule's class adds


@functools.cache
def _instrumented_class(cls: type, field: bool = True) -> type:
    """A subclass of the module class `cls` whose `__call__` logs statistics of its output:
    instances keep their class's fields, methods and `isinstance`, and their leaves' paths.
    With `field`, the options are a static dataclass field (an Equinox module); without, an
    attribute each instance is given (a Flax NNX module: static, in its graphdef)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = getattr(self, _FIELD)
        out = cls.__call__(self, *args, **kwargs)
        if options.per_example and args:  # (set on Linears only)
            out = options.example_norms(args[0], out)
        return options.log(out)

    namespace: dict[str, Any] = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    if field:
        namespace["__annotations__"] = {_FIELD: _Options}
        namespace[_FIELD] = eqx.field(static=True, default=None)
    try:
        return type(cls.__name__, (cls,), namespace)
    except Exception as e:
        raise TypeError(
            f"eqx_logs.instrument cannot instrument {cls.__qualname__}: its class cannot be "
            f"subclassed ({e}). Leave it out with `where=`."
        ) from e


def rebuild(cls: type, module: Any, **extra: Any) -> Any:
    """`module`'s fields in an instance of `cls` (a subclass or the base of its class),
    without running `__init__`: the arrays are the same objects."""
    out = object.__new__(cls)
    for f in dataclasses.fields(cls):
        value = extra[f.name] if f.name in extra else getattr(module, f.name)
        object.__setattr__(out, f.name, value)
    return out


def _instrumented(module: Any, options: _Options) -> Any:
    return rebuild(_instrumented_class(type(module)), module, **{_FIELD: options})


def _plain(module: Any) -> Any:
    """An instrumented submodule as it was."""
    if getattr(module, _FIELD, None) is None:
        return module
    return rebuild(type(module).__mro__[1], module)


def _matcher(where: Any) -> Callable[[str, Any], bool]:
    if where is None:
        return lambda path, module: True
    if isinstance(where, str):
        where = (where,)
    if callable(where):
        return where
    if not isinstance(where, Sequence) or not all(isinstance(w, str) for w in where):
        raise TypeError(
            "eqx_logs.instrument(where=...) takes a path pattern (a string, `*` matching any "
            "characters: 'layers[*].attention'), a sequence of them, or a function "
            f"`(path, module) -> bool`; got {where!r}."
        )
    regex = re.compile("|".join(key_pattern(w) for w in where))
    return lambda path, module: regex.fullmatch(path) is not None


def key_pattern(pattern: str) -> str:
    """A regular expression for a path or key pattern: `*` matches any characters, `?` one,
    everything else itself (brackets included: paths read `layers[0]`)."""
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)


def instrument(
    model: _M,
    *,
    stats: Sequence[str] = DEFAULT_STATS,
    grads: bool = False,
    where: str | Sequence[str] | Callable[[str, Any], bool] | None = None,
    per_example: bool = False,
) -> _M:
    """Log statistics of every submodule's output (and of its gradient) without editing the
    model.

    **Arguments:**

    - `model`: an Equinox model (any pytree holding `eqx.Module`s), or a Flax NNX model:
        then a new NNX graph is returned that shares `model`'s Variables (what a training
        step writes into one is seen in the other), its submodules named by attribute path
        (`"blocks[0].lin"`) and logged by instrumented subclasses of their classes.
    - `stats`: the statistics, names from `"mean"`, `"std"`, `"rms"`, `"absmax"`, `"min"`,
        `"max"`, `"norm"` and `"nonfinite"` (see `eqx_logs.log_stats`).
    - `grads`: also log, in the backward pass, the statistics of the cotangent of each
        submodule's output under `"<path>/grad/<stat>"` (tagged `"instrument"` and
        `"backward"`).
    - `per_example`: each selected `eqx.nn.Linear` also logs, in the backward pass, under
        `"<path>/grad/per_example_norm"`, the norm of each example's gradient of its weight
        through the call, `|x| |g|` from its input and output cotangent: per lane of the
        `jax.vmap` inside the spool (the batch, as in `jax.vmap(model)(xs)`), shape
        `(batch,)` per call. A Linear under two vmaps inside the spool (a batch of sequences,
        vmapped over the tokens) raises: its lanes are tokens, and an example's norm sums
        over them before the norm; use [`eqx_logs.value_grad_and_norms`][] there. A Linear
        called several times per example logs each call's. A single sequence under one
        vmap over its tokens has tokens as lanes: not examples.
    - `where`: which submodules: a path pattern (`*` matches any characters, everything
        else itself: `"layers[*].attention"`), a sequence of them, or a function
        `(path, module) -> bool`. By default every submodule that is called (has
        `__call__`).

    **Returns:**

    A model with the same arrays as leaves in which each selected submodule (not the model
    itself) logs the statistics of its output under `"<path>/<stat>"`, `<path>` its place in
    the tree as `jax.tree_util.keystr` writes it, without the leading dot (`"layers[0]"`,
    `"layers[1].attention"`); a module returning a pytree logs each array leaf under
    `"<path>/<leaf path>/<stat>"`, and a stateful layer's `(y, state)` logs `y`. Events are
    tagged `"instrument"`. The statistics are reduced on device: no activation is kept.

    Each selected submodule becomes an instance of a subclass of its class, with the same
    fields (the same arrays, at the same paths), methods and `isinstance`, and one more
    static field that says what to log. `eqx.filter_jit`, `eqx.filter_grad` and optax work on
    it as on the model; its tree structure differs in those classes, so make the optimiser
    state from the instrumented model. Outside a `spool` or `tap` it compiles to exactly the
    program of the original.

    The statistics are over everything a call computes: under a `jax.vmap` inside the spool
    (over the batch, or Equinox's over the tokens of a sequence) over all lanes together, one
    value per call rather than one per example or token (in a `lax.cond` whose predicate
    that vmap batches: over the lanes that take the branch); under a `jax.vmap` outside it
    (`jax.vmap(spool(f))`: seeds, an ensemble) per lane, each run's own. A layer stacked with
    `eqx.filter_vmap` and applied in `lax.scan` logs one event per layer.

    !!! example

        ```python
        mlp = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
        mlp = eqx_logs.instrument(mlp, grads=True)
        x = jnp.ones(2)
        grad = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))
        grads, logs = eqx_logs.spool(grad)(mlp, x)
        logs["layers[1]/rms"], logs["layers[1]/grad/rms"]
        ```
    """
    stats = check_stats(stats, "eqx_logs.instrument")
    if not isinstance(grads, bool):
        raise TypeError(f"eqx_logs.instrument(grads=...) takes a bool, got {grads!r}.")
    if not isinstance(per_example, bool):
        raise TypeError(f"eqx_logs.instrument(per_example=...) takes a bool, got {per_example!r}.")
    selected = _matcher(where)
    if _nnx.find(model):
        if per_example:
            raise TypeError(
                "eqx_logs.instrument(per_example=True) does eqx.nn.Linear layers of Equinox "
                "models, not Flax NNX ones; use per_example=False."
            )
        return _instrument_nnx(model, stats, grads, selected, where)
    return _instrument_equinox(model, stats, grads, selected, where, per_example)


def _instrument_equinox(
    model: Any, stats: tuple, grads: bool, selected: Callable, where: Any, per_example: bool
) -> Any:
    """`instrument` of Equinox modules: `model` (instrumented already or not) with each
    selected submodule replaced by an instance of an instrumented subclass of its class,
    holding the same arrays; a wrapper module (`__wrapped__`) rebuilt around the result."""
    found, linears = [], []

    def wrap(path: str, module: Any) -> Any:
        if not selected(path, module):
            return module
        found.append(path)
        linear = per_example and isinstance(module, eqx.nn.Linear)
        linears.append(linear)
        return _instrumented(module, _Options(path, stats, grads, linear))

    root = _plain(model)
    instrumented = _map_submodules(wrap, root)
    if isinstance(getattr(type(root), "__wrapped__", None), property):  # a wrapper module
        if not found:
            _check_reachable(root)
        instrumented = update_wrapper(instrumented)  # rebuilt: named again
    if where is not None and not found:
        every = _submodule_paths(root)
        raise ValueError(
            f"eqx_logs.instrument(where={where!r}) selects no submodule of "
            f"{type(root).__name__}; its submodules are {every or 'none'}."
        )
    if per_example and not any(linears):
        raise ValueError(
            f"eqx_logs.instrument(per_example=True) selects no eqx.nn.Linear of "
            f"{type(root).__name__} (selected: {found or 'none'}): only Linears log "
            "per-example norms."
        )
    return instrumented


def _nnx_path(parts: tuple) -> str:
    """A path in an NNX graph, written as `jax.tree_util.keystr` writes an Equinox model's
    (without the leading dot): `layers[0].attention`."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def _instrument_nnx(model: Any, stats: tuple, grads: bool, selected: Callable, where: Any):
    """`instrument` of Flax NNX objects: a new graph (`nnx.merge` of `model`'s split, sharing
    its Variables, so that what a training step writes into either is seen by both) whose
    selected submodules are of an instrumented subclass of their class."""
    nnx = sys.modules["flax.nnx"]
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)  # (the same Variables)
    found = []
    for parts, node in list(nnx.iter_graph(new)):
        if not parts or not isinstance(node, nnx.Module) or not callable(node):
            continue  # (the model itself, Variables, containers, an Rngs)
        cls = type(node)
        if getattr(node, _FIELD, None) is not None:  # instrumented already: again
            cls = cls.__mro__[1]
        path = _nnx_path(parts)
        if not selected(path, node):
            node.__class__ = cls
            continue
        found.append(path)
        node.__class__ = _instrumented_class(cls, field=False)
        object.__setattr__(node, _FIELD, _Options(path, stats, grads))
    if where is not None and not found:
        every = [_nnx_path(p) for p, n in nnx.iter_graph(new) if p and isinstance(n, nnx.Module)]
        raise ValueError(
            f"eqx_logs.instrument(where={where!r}) selects no submodule of "
            f"{type(model).__name__}; its submodules are {every or 'none'}."
        )
    return new


def _submodule_paths(model: Any) -> list[str]:
    paths = []
    _map_submodules(lambda path, m: paths.append(path) or m, model)
    return paths


def _check_reachable(wrapper: Any) -> None:
    """A wrapper module that holds its model's arrays but not its submodules (as
    `eqx.filter_jit(model)` holds a flat list of leaves) cannot have them instrumented: say
    so, rather than log nothing."""
    if _submodule_paths(wrapper):
        return
    hidden = _submodule_paths(wrapper.__wrapped__)
    if hidden:
        listed = ", ".join(hidden[:3]) + (", ..." if len(hidden) > 3 else "")
        raise TypeError(
            f"eqx_logs.instrument cannot reach the submodules of the model inside "
            f"{type(wrapper).__name__} ({listed}): "
            "this wrapper keeps the model's arrays but not its submodules (as "
            "`eqx.filter_jit(model)` does), so none would log. Instrument the model, then "
            "wrap it: `eqx.filter_jit(eqx_logs.instrument(model))`."
        )


def _map_submodules(fun: Callable[[str, Any], Any], model: Any) -> Any:
    """`model` with each callable submodule `m` at path `p` (innermost first, the model
    itself not) replaced by `fun(p, m)`; instrumented submodules are unwrapped first."""

    def children(node: Any, path: tuple) -> Any:
        def visit(p: tuple, x: Any) -> Any:
            if not isinstance(x, eqx.Module):
                return x
            x = _plain(x)
            full = path + tuple(p)
            x = children(x, full)
            return fun(path_name(full), x) if callable(x) else x

        def is_module(x: Any) -> bool:
            return x is not node and isinstance(x, eqx.Module)

        return without_missing(jtu.tree_map_with_path(visit, node, is_leaf=is_module))

    return children(model, ())
