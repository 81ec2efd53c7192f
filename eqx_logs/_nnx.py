"""Flax NNX objects among a wrapper's function and arguments: carried as `nnx.jit` carries them.

An NNX object (a Module, an Optimizer, an `nnx.Pytree`, a Variable) is a mutable graph: a
training step writes new values into its Variables and array attributes in place
(`optimizer.update(model, grads)`, a BatchNorm in training mode, `carry.data = ...`), and may
add attributes (`sow`). `nnx.jit` splits the objects at its door (`nnx.split`), traces the
function on objects merged back from that split (`nnx.merge`), splits them again after the
call and writes the result into the caller's objects (`nnx.update`). Each eqx_logs wrapper
(`spool`, `tap`, `plant`, a logger's `spool`, `tap` and `jit`) does the same through `carry`:
one split of every NNX object found in its function and arguments together (a Variable shared
by two of them stays shared: a tied embedding stays tied), passed in as arrays.

A wrapper flattened and rebuilt by a transform that does not carry NNX state
(`eqx.filter_jit(spool(f))`, `eqx.filter_vmap(...)`) is called on that transform's copies of
the objects, which the transform drops when it returns: a call that changes them raises, naming
what to use instead, rather than lose the update. (`jax.jit(f)` of NNX objects drops them too,
with or without eqx_logs; it cannot be told apart from `nnx.merge` inside a `jax.jit`, the
functional form Flax documents, so it is left to Flax.)

Without flax imported there is no NNX object, and `carry` returns None at once.
"""

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax.tree_util as jtu


def _flax() -> Any:
    return sys.modules.get("flax.nnx")


def _is_node(x: Any) -> bool:
    return _flax().graph.is_graph_node(x)


class _Hole:
    """Where the `index`-th NNX object was: a static leaf (hashable, no array)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __hash__(self) -> int:
        return hash((_Hole, self.index))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hole) and other.index == self.index

    def __repr__(self) -> str:
        return f"<Flax NNX object {self.index}>"


def _fill(tree: Any, nodes: tuple) -> Any:
    return jtu.tree_map(lambda x: nodes[x.index] if isinstance(x, _Hole) else x, tree)


_local = threading.local()


@contextlib.contextmanager
def _carrying() -> Iterator[None]:
    """While a carried function runs: the wrappers inside it write into objects that are
    split again after it (theirs are not lost, even where they were rebuilt)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


class After(eqx.Module):
    """The NNX objects' state after a call, their structure, and whether either changed."""

    state: Any
    graphdef: Any = eqx.field(static=True)
    changed: bool = eqx.field(static=True)


class Merging(eqx.Module):
    """`fun` on NNX objects merged from a split: `Merging(fun, graphdef)(state, *args,
    **kwargs)` merges `state` (a pure dict of arrays) into new objects, puts them in the
    holes of `fun`, `args` and `kwargs`, calls `fun`, and returns its output and the
    objects' `After`."""

    fun: Callable
    graphdef: Any = eqx.field(static=True)

    def __call__(self, state: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, After]:
        nnx = _flax()
        before = jtu.tree_leaves(state)  # (the merged objects hold `state`'s Variables)
        nodes = nnx.merge(self.graphdef, state)
        fun, args, kwargs = _fill((self.fun, args, kwargs), nodes)
        with _carrying():
            out = fun(*args, **kwargs)
        graphdef, after = nnx.split(nodes)
        leaves = jtu.tree_leaves(after)
        changed = (
            graphdef != self.graphdef
            or len(leaves) != len(before)
            or any(a is not b for a, b in zip(leaves, before))
        )
        return out, After(after, graphdef, changed)


class Carried:
    """A call with its NNX objects split out: call `fun` (a `Merging`) on `args` and
    `kwargs`, then `finish` with the `After` it returned."""

    def __init__(self, fun: Callable, args: tuple, kwargs: dict, nodes: list[Any]):
        nnx = _flax()
        self.nodes = tuple(nodes)
        holes, args, self.kwargs = _holes(fun, args, kwargs, nodes)
        graphdef, state = nnx.split(self.nodes)
        self.fun = Merging(holes, graphdef)
        # (as plain arrays: arguments that hold Variables are carried again by `logger.jit`)
        self.args = (nnx.to_pure_dict(state), *args)

    def finish(self, after: After, where: str, rebuilt: bool) -> None:
        """Write `after` into the caller's objects. `rebuilt`: the wrapper was flattened and
        rebuilt by a transform (its objects, that transform's copies, are dropped by it)."""
        if not after.changed:
            return
        if rebuilt and not getattr(_local, "depth", 0):
            raise ValueError(
                f"{where}: the function changes Flax NNX state in place (new values of "
                "Variables or array attributes, or new attributes), but this wrapper was "
                "flattened and rebuilt by a transform that does not carry NNX state "
                "(`eqx.filter_jit`, `eqx.filter_vmap`, `eqx.filter_grad`): the objects "
                "it changes are that transform's copies, dropped when it returns, so the "
                "update would be lost. Use `nnx.jit` around the wrapper, or `logger.jit` "
                "for a training step, which carry it out as `nnx.jit` does; or thread the "
                "state through the transform: `graphdef, state = nnx.split(model)` outside, "
                "`model = nnx.merge(graphdef, state)` ... `return out, nnx.state(model)` "
                "inside, and `nnx.update(model, state)` after."
            )
        nnx = _flax()
        nnx.update(self.nodes, after.state)
        if nnx.graphdef(self.nodes) != after.graphdef:
            raise ValueError(
                f"{where}: the function changes the structure of a Flax NNX object among "
                "its arguments in a way `nnx.update` cannot write back into your objects "
                "(it removes an attribute, or replaces a submodule or a Variable by an "
                "object of another kind). Create that state before the call, or thread the "
                "state functionally: `graphdef, state = nnx.split(model)`, then inside "
                "the wrapped function `model = nnx.merge(graphdef, state)` ... `return out, "
                "nnx.state(model)`, and `nnx.update(model, state)` after it."
            )


def _holes(fun: Callable, args: tuple, kwargs: dict, nodes: list[Any]) -> tuple:
    index = {id(x): i for i, x in enumerate(nodes)}
    return jtu.tree_map(
        lambda x: _Hole(index[id(x)]) if id(x) in index else x,
        (fun, args, kwargs),
        is_leaf=_is_node,
    )


def find(tree: Any) -> list[Any]:
    """The NNX objects in `tree` (not inside one another), each once, in order."""
    if _flax() is None:
        return []
    found: dict[int, Any] = {}
    for x in jtu.tree_leaves(tree, is_leaf=_is_node):
        if _is_node(x):
            found.setdefault(id(x), x)
    return list(found.values())


def carry(fun: Callable, args: tuple, kwargs: dict) -> Carried | None:
    """The call `fun(*args, **kwargs)` with its NNX objects split out (see `Carried`), or
    None where there are none."""
    nodes = find((fun, args, kwargs))
    return Carried(fun, args, kwargs, nodes) if nodes else None


def holds_nodes(treedef: Any) -> bool:
    """Whether a tree of this structure holds NNX objects (found from its node types: a
    structure is checked once by the caller, which caches the answer)."""
    nnx = _flax()
    if nnx is None:
        return False
    pending = [treedef]
    while pending:
        node = pending.pop()
        data = node.node_data()
        if data is not None and issubclass(data[0], (nnx.Pytree, nnx.Variable)):
            return True
        pending.extend(node.children())
    return False


def has_variables(tree: Any) -> bool:
    """Whether `tree` holds an NNX object (whose arrays may change in place)."""
    return bool(find(tree))
