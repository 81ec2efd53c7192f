"""Flax NNX objects among the arguments of a spooled function: their in-place updates.

An NNX module (flax >= 0.11) is a pytree whose `Variable`s are mutable: a training step that
calls `optimizer.update(model, grads)`, or a `BatchNorm` in training mode, writes new values
into them in place, and `nnx.jit` carries those writes out of its trace. `spool`, `tap` and
`plant` trace their function on copies of its arguments (flattened, as `eqx.filter_jit`
does), so the writes land on the copies. `snapshot` records the copies' variables before the
call, `updates` finds what the call wrote, and `apply` writes those values into the objects
the caller passed, as `nnx.jit` does. Changes these cannot carry (an attribute added, as
`sow` does, or replaced) raise an error: they are never dropped in silence.

Without flax imported there is no NNX object, and each function here returns at once.
"""

import sys
from typing import Any

import jax.tree_util as jtu


def _variable_type() -> type | None:
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)


def _get(var: Any) -> Any:
    return var.get_raw_value() if hasattr(var, "get_raw_value") else var.raw_value


def _set(var: Any, value: Any) -> None:
    if hasattr(var, "set_raw_value"):
        var.set_raw_value(value)
    else:
        var.raw_value = value


def _flatten(tree: Any, cls: type) -> tuple[list[Any], Any]:
    return jtu.tree_flatten(tree, is_leaf=lambda x: isinstance(x, cls))


def has_variables(tree: Any) -> bool:
    """Whether `tree` holds an NNX `Variable` (so its arrays may change in place)."""
    cls = _variable_type()
    return cls is not None and any(isinstance(x, cls) for x in _flatten(tree, cls)[0])


class Snapshot:
    """The variables of `tree` (and the other leaves, and its structure) before a call."""

    def __init__(self, tree: Any):
        cls = _variable_type()
        self.cls = cls
        if cls is None:
            self.leaves, self.treedef, self.values = [], None, []
            return
        self.leaves, self.treedef = _flatten(tree, cls)
        self.values = [_get(x) if isinstance(x, cls) else None for x in self.leaves]

    def __bool__(self) -> bool:
        return any(v is not None for v in self.values)


def snapshot(tree: Any) -> Snapshot:
    return Snapshot(tree)


def updates(before: Snapshot, tree: Any, where: str) -> dict[int, Any]:
    """The values the call wrote into the variables of `tree` (as `before` saw it), by
    position among its leaves. `where` names the transform, for errors."""
    if not before:
        return {}
    leaves, treedef = _flatten(tree, before.cls)
    changed = treedef != before.treedef or any(
        (a is not b) and not (isinstance(a, before.cls) and isinstance(b, before.cls))
        for a, b in zip(leaves, before.leaves)
    )
    replaced = [
        i
        for i, (a, b) in enumerate(zip(leaves, before.leaves))
        if isinstance(a, before.cls) and a is not b
    ]
    if changed or replaced:
        raise ValueError(
            f"{where}: the function changes the structure of a Flax NNX object among its "
            "arguments in place (it adds, removes or replaces an attribute or a Variable, as "
            "`sow` or a lazily created state does). Its values are traced on copies, and "
            "only new values of existing Variables are written back into your objects (as "
            "`nnx.jit` does); a change of structure would be lost. Create that state before "
            "the call, or thread the state functionally: `graphdef, state = "
            "nnx.split(model)`, then inside the spooled function `model = "
            "nnx.merge(graphdef, state)` ... `return out, nnx.state(model)`, and "
            "`nnx.update(model, state)` after it."
        )
    return {
        i: _get(x)
        for i, (x, old) in enumerate(zip(leaves, before.values))
        if old is not None and _get(x) is not old
    }


def apply(tree: Any, values: dict[int, Any], where: str) -> None:
    """Write `values` (from `updates`) into the variables of `tree`, which has the structure
    of the tree they were found in."""
    if not values:
        return
    cls = _variable_type()
    assert cls is not None
    leaves, _ = _flatten(tree, cls)
    written: dict[int, Any] = {}
    for i, value in values.items():
        var = leaves[i]
        if id(var) in written and written[id(var)] is not value:
            raise ValueError(
                f"{where}: one Flax NNX Variable appears more than once among the "
                "arguments, and the function writes different values into its copies (each "
                "appearance is traced as its own copy). Pass each Variable once, or thread "
                "the state functionally with `nnx.split` and `nnx.merge`."
            )
        _set(var, value)
        written[id(var)] = value
