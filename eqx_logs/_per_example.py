"""`value_grad_and_norms`: the mean loss, its gradient, and each example's gradient norm,
without materialising per-example gradients.

How: every `eqx.nn.Linear`, `eqx.nn.Embedding`, `eqx.nn.LayerNorm` and `eqx.nn.RMSNorm` of
the model is replaced, while the loss traces, by an instance of a subclass of its class that
logs its input (under a private tag) and taps the cotangent of its output. One
`spool(filter_value_and_grad(mean loss))` then gives, for each call of each layer, the
inputs `X_i` (tokens x in) and output cotangents `G_i` (tokens x out) of every example, from
which the norm of each example's gradient follows without forming it:

- Linear weight: `|x|^2 |g|^2` for one token; else `|X_i^T G_i|_F^2`, or the Gram form
  `<X_i X_i^T, G_i G_i^T>` when the tokens are fewer than the layer is wide. The Linears'
  weights are read behind `stop_gradient` (a zero "probe" the loss is differentiated for is
  added to their outputs, so that the cotangent flows whatever the input depends on), and
  their batch gradient is made from the same logs: `sum_i X_i^T G_i`, the per-example
  products summed when they are formed, so the gradient costs what autodiff's would;
- bias: `|sum_t g_t|^2`;
- Embedding: `sum over ids v of |sum_{t: id_t = v} g_t|^2` (a segment sum over the sorted
  ids);
- LayerNorm / RMSNorm weight: `|sum_t xhat_t * g_t|^2`, `xhat` the layer's own normalised
  input (the layer called without its weight and bias on the logged input).

A layer called several times per example (shared, in a scan, in a Python loop) has the
tokens of all its calls concatenated first: its per-example gradient is the sum over calls.
The backward pass runs a loop's iterations in reverse, so its cotangents are put back in the
forward order first.

Everything else (a Conv, a Linear whose weight the loss also reads other than by calling
it, stacked layers, one whose events did not all arrive) falls back to `jax.grad` of one
example restricted to those parameters, mapped over the batch in chunks (a Linear whose
events did not arrive also has its batch gradient taken again, without logs). Whether a
layer's parameters are read outside its call is read from the loss's jaxpr, traced once with
the layers reading a second copy of their parameters.
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import custom_batching, lax
from jaxtyping import Array, Float, PyTree

from . import _compat
from ._instrument import rebuild
from ._log import Cotangent
from ._primitive import BACKWARD_TAG, bind, call_site, grad_tap
from ._scope import current_steps, no_context_steps, note_steps, unwatched
from ._spool import nolog, spool
from ._stats import path_name

PER_EXAMPLE_TAG = "_eqx_logs_per_example"  # the private tag of the inputs and cotangents
_FIELD = "_eqx_logs_per_example"  # the static field of a tapped layer: its index


@dataclasses.dataclass
class _Trace:
    """What the tapped layers do while the loss traces: with `seen`, read their parameters
    from it (the detection trace); without, log their inputs and tap their cotangents,
    counting each layer's calls in `calls`."""

    seen: dict[int, dict[str, Any]] | None = None
    probe: Any = None  # (a zero the loss is differentiated for: the Linears add it)
    calls: dict[int, int] = dataclasses.field(default_factory=dict)


_current: list[_Trace] = []


@contextlib.contextmanager
def _tracing(state: _Trace) -> Iterator[_Trace]:
    _current.append(state)
    try:
        yield state
    finally:
        _current.pop()


_KINDS = {  # the classes done, by the `__call__` they run
    eqx.nn.Linear: "linear",
    eqx.nn.Embedding: "embedding",
    eqx.nn.LayerNorm: "norm",
    eqx.nn.RMSNorm: "norm",
}
_CLASSES = tuple(_KINDS)


def _tapped_call(cls: type, self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    index = getattr(self, _FIELD)
    state = _current[-1] if _current else None
    if state is not None and state.seen is not None:  # (the detection trace)
        return cls.__call__(rebuild(cls, self, **state.seen[index]), x, *args, **kwargs)
    if state is None or not _compat.logging_enabled.value:
        return cls.__call__(self, x, *args, **kwargs)
    n = state.calls.get(index, 0)
    state.calls[index] = n + 1
    name = f"{PER_EXAMPLE_TAG}/{index}/{n}"
    site = call_site()
    bind({f"{name}/x": x}, {}, tags=(PER_EXAMPLE_TAG,), site=site)
    layer = self
    if isinstance(self, eqx.nn.Linear):  # its gradient is made from the logs
        frozen = {"weight": lax.stop_gradient(self.weight)}
        if self.bias is not None:
            frozen["bias"] = lax.stop_gradient(self.bias)
        layer = rebuild(cls, self, **frozen)
    y = cls.__call__(layer, x, *args, **kwargs)
    if not isinstance(y, jax.Array):
        return y  # (a `(y, state)` pair: no cotangent logged, so the fallback does it)
    if layer is not self:  # (a path for the cotangent, whatever the input depends on)
        y = y + state.probe.astype(y.dtype)
    return grad_tap(Cotangent(f"{name}/g"), site, y, tags=(PER_EXAMPLE_TAG,))


@functools.cache
def _tapped_class(cls: type) -> type:
    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return _tapped_call(cls, self, x, *args, **kwargs)

    namespace: dict[str, Any] = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__annotations__": {_FIELD: int},
        _FIELD: eqx.field(static=True, default=-1),
    }
    return type(cls.__name__, (cls,), namespace)


def _base(cls: type) -> type | None:
    """The class of `_KINDS` whose `__call__` a layer of class `cls` runs (seen through
    `instrument`'s subclass, which only logs statistics of the output); None if another."""
    from ._instrument import _FIELD as INSTRUMENTED

    call = cls.__call__
    if INSTRUMENTED in getattr(cls, "__dataclass_fields__", {}) and len(cls.__mro__) > 1:
        call = cls.__mro__[1].__call__
    return next((base for base in _KINDS if call is base.__call__), None)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """A layer of the model this method can do: `path`, its kind (`"linear"`, `"embedding"`,
    `"norm"`), the indices of its weight and bias among the model's leaves (None: it has
    none), its class of `_KINDS`, and the number of feature axes of its input and output."""

    path: tuple
    kind: str
    weight: int | None
    bias: int | None
    base: type
    x_dims: int
    g_dims: int
    config: Any = None  # (a norm layer: the module, for its static fields)


def _find_layers(model: Any, leaf_index: dict[str, int]) -> list[_Layer]:
    layers = []

    def visit(path: tuple, x: Any) -> Any:
        base = _base(type(x)) if isinstance(x, _CLASSES) else None
        if base is None:
            return x  # (not a layer, or a subclass with a call of its own: the fallback)
        index = {}
        for name in ("weight", "bias"):
            value = getattr(x, name, None)
            i = leaf_index.get(jtu.keystr((*path, jtu.GetAttrKey(name))))
            if value is not None and (i is None or not eqx.is_inexact_array(value)):
                return x  # (frozen, or not where the fields are: the fallback)
            index[name] = None if value is None else i
        kind = _KINDS[base]
        if kind == "linear":
            n_in = 1 if x.in_features == "scalar" else x.in_features
            n_out = 1 if x.out_features == "scalar" else x.out_features
            shape = (n_out, n_in)
            x_dims, g_dims = int(x.in_features != "scalar"), int(x.out_features != "scalar")
        elif kind == "embedding":
            shape, x_dims, g_dims = (x.num_embeddings, x.embedding_size), 0, 1
        else:
            shape = tuple(x.shape)
            x_dims = g_dims = len(shape)
        wants = {"weight": shape, "bias": shape[:1] if kind == "linear" else shape}
        if any(
            getattr(x, k, None) is not None and getattr(x, k).shape != v for k, v in wants.items()
        ):
            return x  # (stacked layers under a scan: the fallback)
        if index["weight"] is None and index["bias"] is None:
            return x
        config = x if kind == "norm" else None
        layers.append(
            _Layer(path, kind, index["weight"], index["bias"], base, x_dims, g_dims, config)
        )
        return x

    jtu.tree_map_with_path(visit, model, is_leaf=lambda x: isinstance(x, _CLASSES))
    return layers


def _tap_layers(model: Any, layers: list[_Layer], which: set[int]) -> Any:
    """`model` with the layers `which` (indices into `layers`) of tapped classes."""
    by_path = {jtu.keystr(layer.path): i for i, layer in enumerate(layers) if i in which}

    def visit(path: tuple, x: Any) -> Any:
        i = by_path.get(jtu.keystr(path)) if isinstance(x, _CLASSES) else None
        if i is None:
            return x
        return rebuild(_tapped_class(type(x)), x, **{_FIELD: i})

    return jtu.tree_map_with_path(visit, model, is_leaf=lambda x: isinstance(x, _CLASSES))


def _used_inputs(jaxpr: Any) -> list[bool]:
    """Which of `jaxpr`'s inputs its equations read; through `jit`, `closed_call`, `remat`,
    `scan`, custom_jvp/vjp calls (any equation whose sub-jaxprs take its inputs one for one),
    and conservatively (every input of the equation read) through anything else."""
    used: set[Any] = set()
    for eqn in reversed(jaxpr.eqns):
        invars = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
        subs = [p for p in eqn.params.values() if hasattr(p, "eqns") and hasattr(p, "invars")]
        if subs and all(len(s.invars) == len(eqn.invars) for s in subs):
            flags = [False] * len(eqn.invars)
            for s in subs:
                flags = [a or b for a, b in zip(flags, _used_inputs(s), strict=True)]
            used.update(v for v, f in zip(eqn.invars, flags) if f and v in invars)
        else:
            used.update(invars)
    outs = {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    return [v in used or v in outs for v in jaxpr.invars]


def _tokens(a: Array, count: Array, feature_ndim: int, backward: bool) -> Array:
    """A logged `(events, batch, *lanes, *features)` stack as `(batch, tokens, features)`
    (the features flattened, one if none), the events beyond each lane's count zeroed. The
    backward pass runs a loop's iterations in reverse: with `backward`, each lane's events
    are put back in the forward order (a nested loop's too: reversing both levels reverses
    the flattened order)."""
    events, batch = a.shape[:2]
    index = jnp.arange(events, dtype=count.dtype).reshape((events,) + (1,) * count.ndim)
    valid = index < count[None]
    if backward and events > 1:
        order = jnp.where(valid, count[None] - 1 - index, index)
        order = order.reshape(order.shape + (1,) * (a.ndim - order.ndim))
        a = jnp.take_along_axis(a, order, axis=0)
    valid = valid.reshape(valid.shape + (1,) * (a.ndim - valid.ndim))
    a = jnp.where(valid, a, jnp.zeros((), a.dtype))
    features = math.prod(a.shape[a.ndim - feature_ndim :])
    return jnp.moveaxis(a, 0, 1).reshape((batch, -1, features))


def _layer_results(
    layer: _Layer, xs: list[Array], gs: list[Array], dtype: Any
) -> dict[int, tuple[Array, Array | None]]:
    """For the weight and bias of `layer` (by leaf index): each example's squared gradient
    norm (of the mean loss: the cotangents are its), and for a Linear the batch gradient,
    from its calls' inputs and output cotangents `(batch, tokens, features)`."""
    g = jnp.concatenate(gs, axis=1).astype(dtype)
    out: dict[int, tuple[Array, Array | None]] = {}
    if layer.bias is not None:
        summed = jnp.sum(g, axis=1)
        grad = jnp.sum(summed, axis=0) if layer.kind == "linear" else None
        out[layer.bias] = (jnp.sum(summed**2, axis=1), grad)
    if layer.weight is None:
        return out
    if layer.kind == "embedding":  # each row's gradient sums the tokens of its id
        ids = jnp.concatenate(xs, axis=1)[..., 0]
        batch, tokens, width = g.shape
        order = jnp.argsort(ids, axis=1, stable=True)
        ids = jnp.take_along_axis(ids, order, axis=1)
        g = jnp.take_along_axis(g, order[..., None], axis=1)
        first = jnp.concatenate(
            [jnp.ones((batch, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1
        )  # (a run of one id in the sorted tokens: one row)
        runs = jnp.cumsum(first.astype(jnp.int32), axis=1) - 1
        runs = runs + tokens * jnp.arange(batch, dtype=jnp.int32)[:, None]
        rows = jax.ops.segment_sum(
            g.reshape(batch * tokens, width), runs.reshape(-1), num_segments=batch * tokens
        )
        squares = jnp.sum(jnp.sum(rows**2, axis=1).reshape(batch, tokens), axis=1)
        out[layer.weight] = (squares, None)
        return out
    x = jnp.concatenate(xs, axis=1)
    if layer.kind == "norm":
        plain = rebuild(
            layer.base, layer.config, weight=None, bias=None, use_weight=False, use_bias=False
        )
        shape = tuple(layer.config.shape)
        h = jax.vmap(plain)(x.reshape((-1, *shape))).reshape(x.shape).astype(dtype)
        out[layer.weight] = (jnp.sum(jnp.sum(h * g, axis=1) ** 2, axis=1), None)
        return out
    x = x.astype(dtype)
    tokens, n_in, n_out = x.shape[1], x.shape[2], g.shape[2]
    if tokens == 1:
        squares = jnp.sum(x[:, 0] ** 2, axis=1) * jnp.sum(g[:, 0] ** 2, axis=1)
        grad = jnp.einsum("bi,bo->oi", x[:, 0], g[:, 0])
    elif tokens * (n_in + n_out) < n_in * n_out:  # the Gram matrices are the smaller
        xx = jnp.einsum("bti,bsi->bts", x, x)
        gg = jnp.einsum("bto,bso->bts", g, g)
        squares = jnp.sum(xx * gg, axis=(1, 2))
        grad = jnp.einsum("bti,bto->oi", x, g)
    else:  # each example's weight gradient, summed for the batch's
        each = jnp.einsum("bti,bto->boi", x, g)
        squares = jnp.sum(each**2, axis=(1, 2))
        grad = jnp.sum(each, axis=0)
    out[layer.weight] = (squares, grad)
    return out


def value_grad_and_norms(
    loss_fn: Callable[..., Any] | None = None,
    /,
    *,
    by_layer: bool = False,
    chunk_size: int | None = 8,
) -> Callable[..., tuple[Float[Array, ""], PyTree, Any]]:
    """The mean loss over a batch, its gradient, and each example's gradient norm, without
    materialising per-example gradients.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *example)`, the scalar loss of one example (as one would
        pass to `jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, ...))`). Also works as a
        decorator with options only: `@eqx_logs.value_grad_and_norms(by_layer=True)`.
    - `by_layer`: return, instead of the total norms, a dict from each parameter's path
        (`"layers[0].weight"`) to its per-example gradient norms.
    - `chunk_size`: how many examples at a time the parameters this method cannot do are
        differentiated for (`jax.lax.map(..., batch_size=chunk_size)`); None: all at once.

    **Returns:**

    A function `(model, *batch) -> (loss, grads, norms)`, the batch arrays with a leading
    batch axis: `loss` the mean of `loss_fn` over the batch; `grads` its gradient, as
    `eqx.filter_value_and_grad` gives it (None at non-array leaves); `norms`, float
    `(batch,)`, the norm of each example's own gradient `|grad loss_fn(model, *example_i)|`
    (not divided by the batch size), or with `by_layer` the dict of each parameter's.

    The parameters of `eqx.nn.Linear` (inside `eqx.nn.MLP`, `eqx.nn.MultiheadAttention` and
    any model, with or without a sequence axis under `jax.vmap`, called once or several times
    per example, in a `lax.scan` too), `eqx.nn.Embedding`, `eqx.nn.LayerNorm` and
    `eqx.nn.RMSNorm` are done from each call's inputs and output cotangents, at about the
    cost of the step without norms. Every other parameter (a Conv's, a Linear whose weight
    the loss also reads other than by calling it: a weight penalty, tied weights) is
    differentiated per example, `jax.vmap(jax.grad)` restricted to those, in chunks. The logs
    of `loss_fn` reach an enclosing `spool` once per event, as from the batch's forward pass
    under `jax.vmap`. Differentiating through it again (a meta-gradient) is not supported:
    the Linears' gradients are assembled from logged values.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))

        def loss_fn(model, x, y):
            return jnp.sum((model(x) - y) ** 2)

        x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        loss, grads, norms = eqx_logs.value_grad_and_norms(loss_fn)(mlp, x, y)
        norms.shape  # (4,)
        ```
    """
    if loss_fn is None:
        return functools.partial(value_grad_and_norms, by_layer=by_layer, chunk_size=chunk_size)
    if not callable(loss_fn):
        raise TypeError(
            f"eqx_logs.value_grad_and_norms takes the loss of one example, "
            f"`loss_fn(model, *example)`; got {type(loss_fn).__name__}."
        )
    if not isinstance(by_layer, bool):
        raise TypeError(f"value_grad_and_norms(by_layer=...) takes a bool, got {by_layer!r}.")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"value_grad_and_norms(chunk_size=...) takes a positive int (examples "
            f"differentiated at a time by the fallback) or None (all), got {chunk_size!r}."
        )
    return eqx.filter_jit(functools.partial(_value_grad_and_norms, loss_fn, by_layer, chunk_size))


def _value_grad_and_norms(
    loss_fn: Callable, by_layer: bool, chunk_size: int | None, model: Any, *batch: Any
) -> tuple[Any, Any, Any]:
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jtu.tree_leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "eqx_logs.value_grad_and_norms(loss_fn)(model, *batch): every batch array needs "
            f"the same leading batch axis; got leading sizes {sorted(map(str, sizes))}."
        )
    (n,) = sizes
    leaves_paths, treedef = jtu.tree_flatten_with_path(model)
    leaves = [x for _, x in leaves_paths]
    params = [i for i, x in enumerate(leaves) if eqx.is_inexact_array(x)]
    leaf_index = {jtu.keystr(p): i for i, (p, _) in enumerate(leaves_paths)}
    layers = _find_layers(model, leaf_index)
    covered = _not_read_elsewhere(loss_fn, batch, layers, leaves, treedef)

    state = _Trace()

    def mean_loss(differentiated: tuple[Any, Any]) -> Any:
        m, state.probe = differentiated
        with _tracing(state):
            state.calls.clear()
            tapped = _tap_layers(m, layers, covered)
            losses = jax.vmap(lambda *example: loss_fn(tapped, *example))(*batch)
            if jnp.shape(losses) != (n,):
                raise ValueError(
                    "eqx_logs.value_grad_and_norms: loss_fn(model, *example) must return a "
                    f"scalar for one example; under jax.vmap it returned shape "
                    f"{jnp.shape(losses)} for a batch of {n}."
                )
            return jnp.mean(losses)

    grad_fn = eqx.filter_value_and_grad(mean_loss)
    probe = jnp.zeros((), jnp.float32)
    (loss, (grads, _)), logs = spool(grad_fn, tags=PER_EXAMPLE_TAG)((model, probe))
    grad_leaves = treedef.flatten_up_to(grads)  # (None at the model's non-array leaves)

    wide = any(jnp.dtype(leaves[i].dtype).itemsize > 4 for i in params)
    dtype = jnp.float64 if wide else jnp.float32
    scale = jnp.asarray(n * n, dtype)  # (the cotangents are the mean loss's)
    squares: dict[int, Array] = {}
    regrad: list[int] = []  # (Linears whose events did not all arrive: their batch gradient)
    for i in sorted(covered):
        layer = layers[i]
        mine = [j for j in (layer.weight, layer.bias) if j is not None]
        keys = [f"{PER_EXAMPLE_TAG}/{i}/{c}" for c in range(state.calls.get(i, 0))]
        if not all(f"{k}/x" in logs and f"{k}/g" in logs for k in keys):
            if layer.kind == "linear":
                regrad += mine
            continue  # (the fallback does its norms)
        if not keys:  # (never called: no gradient)
            squares.update({j: jnp.zeros((n,), dtype) for j in mine})
            continue
        xs = [_tokens(logs[f"{k}/x"], logs.count[f"{k}/x"], layer.x_dims, False) for k in keys]
        gs = [_tokens(logs[f"{k}/g"], logs.count[f"{k}/g"], layer.g_dims, True) for k in keys]
        for j, (sq, grad) in _layer_results(layer, xs, gs, dtype).items():
            squares[j] = sq * scale
            if grad is not None:
                grad_leaves[j] = grad.reshape(leaves[j].shape).astype(leaves[j].dtype)
    if regrad:
        batch_grads = _batch_gradient(loss_fn, batch, regrad, leaves, treedef)
        grad_leaves = [batch_grads.get(i, g) for i, g in enumerate(grad_leaves)]
    grads = jtu.tree_unflatten(treedef, grad_leaves)
    rest = [i for i in params if i not in squares]
    if rest:
        squares.update(_fallback(loss_fn, model, batch, rest, leaves, treedef, chunk_size))
    if by_layer:
        norms = {path_name(leaves_paths[i][0]): jnp.sqrt(squares[i]) for i in params}
    else:
        total = sum((squares[i] for i in params), jnp.zeros((n,), dtype))
        norms = jnp.sqrt(total)
    return loss, grads, norms


def _with(leaves: list, indices: list[int], arrays: list) -> list:
    full = list(leaves)
    for i, a in zip(indices, arrays, strict=True):
        full[i] = a
    return full


def _not_read_elsewhere(
    loss_fn: Callable, batch: Any, layers: list[_Layer], leaves: list, treedef: Any
) -> set[int]:
    """The layers whose weight and bias the loss reads only by calling the layer: traced once
    (without logs) with the tapped layers reading a second copy of their parameters, the
    model's own copy unread in the jaxpr."""
    if not layers:
        return set()
    mine = sorted({i for layer in layers for i in (layer.weight, layer.bias) if i is not None})

    def forward(model_arrays: list, seen_arrays: list, batch: Any) -> Any:
        m = jtu.tree_unflatten(treedef, _with(leaves, mine, model_arrays))
        copy = dict(zip(mine, seen_arrays, strict=True))
        seen = {
            k: {
                name: copy[j]
                for name, j in (("weight", layer.weight), ("bias", layer.bias))
                if j is not None
            }
            for k, layer in enumerate(layers)
        }
        with _tracing(_Trace(seen=seen)):
            tapped = _tap_layers(m, layers, set(range(len(layers))))
            return jnp.sum(jax.vmap(lambda *example: loss_fn(tapped, *example))(*batch))

    abstract = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in mine]
    jaxpr = jax.make_jaxpr(nolog(forward))(abstract, abstract, batch)
    used = dict(zip(mine, _used_inputs(jaxpr.jaxpr)[: len(mine)], strict=True))
    return {
        k
        for k, layer in enumerate(layers)
        if not any(used[j] for j in (layer.weight, layer.bias) if j is not None)
    }


def _batch_gradient(
    loss_fn: Callable, batch: Any, which: list[int], leaves: list, treedef: Any
) -> dict[int, Array]:
    """The mean loss's gradient for the parameters `which` (leaf indices), without logs (the
    batch's forward pass logged them)."""

    def mean(arrays: list) -> Any:
        m = jtu.tree_unflatten(treedef, _with(leaves, which, arrays))
        return jnp.mean(jax.vmap(lambda *example: loss_fn(m, *example))(*batch))

    grads = jax.grad(nolog(mean))([leaves[i] for i in which])
    return dict(zip(which, grads, strict=True))


def _fallback(
    loss_fn: Callable,
    model: Any,
    batch: Any,
    rest: list[int],
    leaves: list,
    treedef: Any,
    chunk_size: int | None,
) -> dict[int, Array]:
    """Each example's squared gradient norm of the parameters `rest` (leaf indices), by
    `jax.grad` of one example's loss restricted to them (without logs: the batch's forward
    pass logged them), `chunk_size` examples at a time."""

    def one(example: tuple) -> list[Array]:
        def loss(arrays: list) -> Any:
            return loss_fn(jtu.tree_unflatten(treedef, _with(leaves, rest, arrays)), *example)

        grads = jax.grad(nolog(loss))([leaves[i] for i in rest])
        return [jnp.sum(jnp.square(g)) for g in grads]

    if chunk_size is None:
        out = jax.vmap(one)(batch)
    else:
        out = lax.map(one, batch, batch_size=chunk_size)
    return dict(zip(rest, out, strict=True))


# `instrument(..., per_example=True)`: an instrumented Linear logs, in the backward pass, the
# norm of each example's gradient of its weight through the call, `|x| |g|` from the saved
# input `x` and the output's cotangent `g`, per lane of the one `jax.vmap` inside the spool
# (the batch). Under two (a sequence axis: the lanes are tokens) that is no per-example norm:
# an error at trace time, which the probes below raise. The probes are identities whose
# batching rules act only while a spool or tap traces (logging on): a `jax.vmap` outside it
# (`jax.vmap(spool(f))`, independent runs) reaches them when the traced program is run, with
# logging off, and passes.


@custom_batching.custom_vmap
def _second_vmap(x: Array) -> Array:
    return x


@_second_vmap.def_vmap
def _second_vmap_rule(axis_size: int, in_batched: list, x: Array) -> tuple[Array, bool]:
    if _compat.logging_enabled.value:
        raise ValueError(_TWO_VMAPS.format(name=_naming[-1] if _naming else "?"))
    return x, in_batched[0]


@custom_batching.custom_vmap
def _first_vmap(x: Array) -> Array:
    return x


@_first_vmap.def_vmap
def _first_vmap_rule(axis_size: int, in_batched: list, x: Array) -> tuple[Array, bool]:
    if _compat.logging_enabled.value:
        _second_vmap(x)  # (a second vmap inside the spool batches this one)
    return x, in_batched[0]


_naming: list[str] = []  # the key whose norms are being traced (for the error)
_TWO_VMAPS = (
    "eqx_logs.instrument(per_example=True): {name!r} is under two jax.vmaps inside the "
    "spool (a batch of sequences, the layer vmapped over the tokens), where each lane is a "
    "token, not an example: the norm of an example's weight gradient sums over its tokens "
    "before the norm, which the layer's lanes cannot give. Use "
    "eqx_logs.value_grad_and_norms(loss_fn)(model, *batch) for per-example gradient norms "
    "of a sequence model, or instrument it with per_example=False."
)


def per_example_tap(name: str, site: str, x: Any, y: Any, tags: tuple[str, ...]) -> Any:
    """`y`, the output of an `eqx.nn.Linear` called on `x`; in the backward pass, logs
    under `name` the norm of the weight's gradient through this call, `|x| |g|` for the
    cotangent `g` of `y`: per lane of a `jax.vmap` inside the spool, an error under two."""
    if not _compat.logging_enabled.value or not isinstance(y, jax.Array):
        return y
    steps = current_steps()
    note_steps(steps, site)
    return _norm_tap(name, site, (BACKWARD_TAG, *tags), y, lax.stop_gradient(x), steps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _norm_tap(name: str, site: str, tags: tuple, y: Any, x: Any, steps: dict) -> Any:
    return y


def _norm_tap_fwd(name: str, site: str, tags: tuple, y: Any, x: Any, steps: dict) -> Any:
    return y, (x, steps)


def _norm_tap_bwd(name: str, site: str, tags: tuple, residuals: Any, ct: Any) -> Any:
    x, steps = residuals
    if _compat.logging_enabled.value:
        _naming.append(name)
        try:
            _first_vmap(ct)
        finally:
            _naming.pop()
        dtype = jnp.float64 if jnp.dtype(ct.dtype).itemsize > 4 else jnp.float32
        squares = jnp.sum(jnp.square(x.astype(dtype))) * jnp.sum(jnp.square(ct.astype(dtype)))
        with no_context_steps(), unwatched():
            bind({name: jnp.sqrt(squares)}, steps, tags=tags, site=site)
    zeros = jtu.tree_map(lambda s: np.zeros(np.shape(s), jax.dtypes.float0), steps)
    return ct, jnp.zeros_like(x), zeros


_norm_tap.defvjp(_norm_tap_fwd, _norm_tap_bwd)
