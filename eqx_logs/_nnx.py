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

`logger.jit`, the per-step loop's form, carries the objects passed as its arguments
themselves (`step(model, optimizer, x, y, i)`) per structure (`Fast`): Flax's graph flatten
(1.7 ms, and 1.2 ms for `nnx.update`, for a two-layer classifier and its adam optimizer on
a shared 2-core CPU) runs when the objects or their structure are new, and each call reads
the arrays with JAX's pytree flatten, checked against the structure found (the same
objects, met in the same order, the same pytree structure: the same graph), and writes the
new arrays into the Variables. Objects inside another argument, passed by keyword, inside
the function, or holding what is not a JAX array are carried by `carry` at each call.

Without flax imported there is no NNX object, and `carry` returns None at once.
"""

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu


def _flax() -> Any:
    return sys.modules.get("flax.nnx")


def flax_imported() -> bool:
    return "flax.nnx" in sys.modules


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

    def finish(self, after: After, where: str, rebuilt: bool, donated: bool = False) -> None:
        """Write `after` into the caller's objects. `rebuilt`: the wrapper was flattened and
        rebuilt by a transform (its objects, that transform's copies, are dropped by it);
        `donated`: the objects' arrays were donated to the call (written back unchanged)."""
        if not after.changed and not donated:
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
            raise ValueError(_NOT_WRITTEN.format(where=where))


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


def unwrapped(fun: Callable) -> Callable:
    """`fun`, or the function of a plain `nnx.jit(fun)` (no shardings): called inside a
    compiled step that carries the NNX objects itself (`logger.jit`'s), `nnx.jit` adds nothing
    but a nested `jax.jit`, whose arguments are new tracers (the step given to it is not the
    call's own: `logger.jit(nnx.jit(step), state, step="i")` could not skip the logs of the
    steps an interval skips)."""
    compilation = sys.modules.get("flax.nnx.transforms.compilation")
    wrapped = getattr(compilation, "JitWrapped", None)
    if (
        wrapped is not None
        and type(fun) is wrapped
        and getattr(fun, "in_shardings", 0) is None
        and getattr(fun, "out_shardings", 0) is None
        and callable(getattr(fun, "fun", None))
    ):
        return fun.fun
    return fun


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


# `logger.jit`'s carry, per structure (`Fast`): a training loop calls its step on the same
# objects at every call, so what depends only on them (the graph's structure, its Variables,
# where each Variable's array is among the objects' leaves) is found once, by Flax's graph
# flatten, and each call reads the arrays with JAX's pytree flatten (in C++, ~30x faster on a
# small model) and writes the new ones into the Variables.


class Written(eqx.Module):
    """What `Flat` returns beside the function's output: the objects' arrays after the call,
    their structure, whether it is the structure they came in with, and whether anything
    changed."""

    leaves: list
    graphdef: Any = eqx.field(static=True)
    same: bool = eqx.field(static=True)
    changed: bool = eqx.field(static=True)


class Flat(eqx.Module):
    """`fun` on NNX objects rebuilt from their arrays: `Flat(fun, graphdef)(leaves, *args,
    **kwargs)` unflattens `leaves` (the arrays of the objects' Variables, in the order of Flax's
    graph flatten) into new objects, puts them in the holes of `fun`, `args` and `kwargs`,
    calls `fun`, and returns its output and the objects' `Written`. (`Merging`, with arrays
    in place of a state dict.)"""

    fun: Callable
    graphdef: Any = eqx.field(static=True)

    def __call__(self, leaves: list, /, *args: Any, **kwargs: Any) -> tuple[Any, Written]:
        graph = _flax().graph
        nodes = graph.unflatten(self.graphdef, list(leaves))
        fun, args, kwargs = _fill((self.fun, args, kwargs), nodes)
        with _carrying():
            out = fun(*args, **kwargs)
        graphdef, after = graph.flatten(nodes, with_paths=False)
        same = graphdef == self.graphdef
        changed = (
            not same or len(after) != len(leaves) or any(a is not b for a, b in zip(after, leaves))
        )
        return out, Written(list(after), graphdef, same, changed)


class Structure:
    """The NNX objects of a call, found once: the structure JAX's pytree flatten gives them
    (`treedef`, every NNX object met on the way, in order, and the leaves' types: equal at a
    later call, the objects are the same graph, in the same places, holding the same kinds
    of arrays), Flax's graph of them (`graphdef`), where its Variables (each once, in the
    graph's order) and array attributes are among the objects (`places`) and where each one's
    array is among the pytree leaves (`take`; None for objects `Fast` leaves to `carry`, found
    so once). It holds no object itself, only their `id`s, compared while the objects of a
    call are alive (a model the loop no longer uses is not kept alive, nor its arrays); the
    Variables a call writes are its own objects at `places`."""

    __slots__ = ("treedef", "ids", "types", "graphdef", "places", "take", "jit")

    def __init__(self, treedef, objects, types, graphdef, places, take):
        self.treedef, self.ids, self.types = treedef, tuple(map(id, objects)), types
        self.graphdef, self.places, self.take = graphdef, places, take
        self.jit: Any = None  # (the compiled step of `Flat(fun, graphdef)`, set by the caller)

    def matches(self, treedef: Any, objects: list, types: tuple) -> bool:
        if len(objects) != len(self.ids) or types != self.types:
            return False
        if tuple(map(id, objects)) != self.ids:
            return False
        try:
            return bool(treedef == self.treedef)
        except (TypeError, ValueError):  # (a static attribute that does not compare: `==`
            # of an array)
            return False


# type -> whether it is a Flax NNX object (a graph node or a Variable)
_TYPES: dict[type, bool] = {}


def is_nnx(x: Any) -> bool:
    """Whether `x` is a Flax NNX object (a graph node or a Variable)."""
    t = type(x)
    known = _TYPES.get(t)
    if known is None:
        nnx = _flax()
        known = _TYPES[t] = nnx is not None and (
            issubclass(t, nnx.Variable) or nnx.graph.is_graph_node(x)
        )
    return known


class Fast:
    """`logger.jit`'s carry of the NNX objects passed as its arguments themselves (`step(model,
    optimizer, x, y, i)`), as `Carried` carries them with the cost of a Flax graph flatten and
    `nnx.update` at every call, per structure: `split` reads the arrays, `write` writes the
    new ones back. The last structure is kept (a loop calls on the same objects)."""

    __slots__ = ("last",)

    def __init__(self):
        self.last: Structure | None = None

    def split(self, args: tuple) -> "tuple[Structure, list, tuple, Targets] | None":
        """`(structure, leaves, args, targets)`: the objects' arrays in the graph's order,
        `args` with holes in their place, and what `write` writes into; None where no
        argument is an NNX object or where this
        form does not apply (an object holding an array that is not a JAX array, a mutable
        array, a value that is not an array inside a Variable, a Flax object JAX does not
        flatten): `carry` does those."""
        roots: list = []
        holed = list(args)
        for j, x in enumerate(args):
            if is_nnx(x):
                holed[j] = _Hole(len(roots))
                roots.append(x)
        if not roots:
            return None
        objects: list = []
        append = objects.append

        def visit(x: Any) -> bool:
            if is_nnx(x):
                append(x)
            return False

        leaves, treedef = jtu.tree_flatten(roots, is_leaf=visit)
        types = tuple(map(type, leaves))
        structure = self.last
        if structure is None or not structure.matches(treedef, objects, types):
            structure = _structure(roots, treedef, objects, types, leaves)
            self.last = structure
        if structure.take is None:  # (a structure `carry` carries)
            return None
        leaves = [leaves[k] for k in structure.take]
        return structure, leaves, tuple(holed), Targets(tuple(roots), objects)

    def write(
        self,
        structure: Structure,
        targets: "Targets",
        written: Written,
        where: str,
        donated: bool = False,
    ) -> None:
        """Write a call's `Written` into its objects (`targets`), as `nnx.update` does (what
        the call did not change too, where their arrays were `donated`: the objects hold
        them)."""
        if not written.changed and not donated:
            return
        if written.same:
            objects = targets.objects
            for (k, key), value in zip(structure.places, written.leaves, strict=True):
                if key is None:  # a Variable
                    objects[k].set_raw_value(value, _unsafe_bypass_check=True)
                else:  # an array attribute of an `nnx.Pytree`, as `nnx.update` sets it
                    owner = objects[k]
                    _flax().graph.get_node_impl(owner).set_key(owner, key, value)
            return
        nnx = _flax()  # (the next call finds its structure again, `Structure.matches`)
        rebuilt = nnx.graph.unflatten(written.graphdef, written.leaves)
        nnx.update(targets.roots, nnx.state(rebuilt))
        if nnx.graphdef(targets.roots) != written.graphdef:
            raise ValueError(_NOT_WRITTEN.format(where=where))


class Targets:
    """The objects of one call (`Fast.split`), which its new arrays are written into: the NNX
    arguments (`roots`) and every NNX object met in their pytree flatten (`objects`)."""

    __slots__ = ("roots", "objects")

    def __init__(self, roots: tuple, objects: list):
        self.roots, self.objects = roots, objects


def _structure(roots: list, treedef: Any, objects: list, types: tuple, leaves: list):
    """The `Structure` of a call's objects (its `take` None where `Fast` does not apply)."""
    found = _found(roots, objects, leaves, types)
    graphdef, places, take = found if found is not None else (None, None, None)
    return Structure(treedef, objects, types, graphdef, places, take)


def _found(roots: list, objects: list, leaves: list, types: tuple) -> tuple[Any, list, list] | None:
    """The graph of `roots`, where its Variables (and the owners of its array attributes)
    are among `objects` (`(index, None)`, `(index, attribute)`) and where their arrays are
    among `leaves`, or None where `Fast` does not apply."""
    nnx = _flax()
    if not all(issubclass(t, jax.Array) for t in types):
        return None
    nodes = tuple(roots)
    graphdef, flat = nnx.graph.flatten(nodes)
    # Where each of the graph's leaves is among the pytree leaves (which repeat a shared
    # object's): a Variable's array is the leaf after it; an array attribute's, the next
    # leaf outside a repeat, in the graph's order (both sort attributes), checked by identity.
    at: dict[int, int] = {}
    owned: set[int] = set()  # (the leaves that are Variables' arrays)
    plain: list[int] = []
    seen: set[int] = set()
    count = 0

    def visit(x: Any) -> bool:
        nonlocal count
        if is_nnx(x):
            if id(x) in seen:  # (a repeat: the graph holds a reference, no leaves)
                count += len(jtu.tree_leaves(x))
                return True
            seen.add(id(x))
            if isinstance(x, nnx.Variable):
                at[id(x)] = count
                owned.add(count)
        elif isinstance(x, jax.Array):
            if count not in owned:
                plain.append(count)
            count += 1
        return False

    jtu.tree_flatten(roots, is_leaf=visit)
    if count != len(leaves):
        return None
    index: dict[int, int] = {}  # an object's id -> its first place among `objects`
    for k, x in enumerate(objects):
        index.setdefault(id(x), k)
    places, take = [], []
    plains = iter(plain)
    for path, leaf in flat:
        if isinstance(leaf, nnx.Variable):
            k = at.get(id(leaf))
            if k is None or leaves[k] is not leaf.get_raw_value():
                return None  # (a mutable array, a value that is not one array)
            places.append((index[id(leaf)], None))  # (met in the flatten: `at`)
        else:  # an array attribute of an `nnx.Pytree`: written back into its owner
            k = next(plains, None)
            owner = _owner(nodes, path)
            if k is None or owner is None or leaves[k] is not leaf or id(owner) not in index:
                return None
            if sum(x is leaf for x in leaves) != 1:  # (its place is not known by identity)
                return None
            places.append((index[id(owner)], path[-1]))
        take.append(k)
    if next(plains, None) is not None:
        return None
    return graphdef, places, take


def _owner(nodes: tuple, path: tuple) -> Any:
    """The NNX object holding the array attribute at `path` (None where it is not one)."""
    owner: Any = nodes
    try:
        for key in path[:-1]:
            owner = getattr(owner, key) if isinstance(key, str) else owner[key]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    nnx = _flax()
    if not isinstance(owner, nnx.Pytree) or nnx.graph.get_node_impl(owner) is None:
        return None
    return owner


_NOT_WRITTEN = (
    "{where}: the function changes the structure of a Flax NNX object among its arguments "
    "in a way `nnx.update` cannot write back into your objects (it removes an attribute, or "
    "replaces a submodule or a Variable by an object of another kind). Create that state "
    "before the call, or thread the state functionally: `graphdef, state = "
    "nnx.split(model)`, then inside the wrapped function `model = nnx.merge(graphdef, "
    "state)` ... `return out, nnx.state(model)`, and `nnx.update(model, state)` after it."
)
