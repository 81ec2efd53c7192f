"""The `log` primitive and the user-facing functions that bind it: `log`, `log_grad`, `scope`.

One call to `log` binds `log_p` once. Its operands are the value leaves of every key, then the
step scalars, then (if `masked`) a boolean validity mask; its parameters say how to rebuild
them (`treedef`, `steps`) and carry the call's `tags`, `reduce`, `site` (where it was called,
for error messages), `nbatch` (how many leading axes vmap added) and `axis_names` (their
`vmap` axis names, outermost first; None where unnamed). The mask is added by
`_masking.py` when vmap turns a cond or while loop with a batched predicate into code that runs
every branch or iteration for every lane: it marks the lanes where the event really happens.
For a cond, `branches` then records which branch of which batched cond the log is in (pairs
`(cond, branch)`, sorted): a lane takes one branch of each, so the events of different
branches of one cond exclude each other, and a spool bounds them by the maximum over the
branches, as without vmap.
`log_p` has no outputs and an effect of its own, so it survives DCE, AD, remat and control
flow until a spool or tap interprets it.
"""

import contextlib
import dataclasses
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import ArrayLike, PyTree

from . import _compat
from ._buffers import as_reduction
from ._deferred import force


class LogEffect(_compat.Effect):
    """The effect of `log_p`: keeps a log alive until a spool or tap consumes it."""

    def __repr__(self) -> str:
        return "eqx_logs.LogEffect"


log_effect = LogEffect()
_compat.register_effect(LogEffect)


def _lost_message(site: str, rule: str) -> str:
    return (
        f"eqx_logs.log at {site}, in a custom derivative rule of {rule}, ran outside every "
        "spool and tap, so its events are lost: the derivative was taken outside the spool "
        "(as in `jax.grad(spool(f))`), and the spool's outputs were fixed by the primal "
        "function. Put the spool outside the derivative to capture them: "
        "`eqx_logs.spool(jax.grad(f))`."
    )


class LostEventsWarning(UserWarning):
    """Log events that no spool or tap captured (see `_lost_message`)."""


class _LogPrimitive(_compat.Primitive):
    """A log bound where no spool or tap is tracing (logging off) is dropped, as `log` is
    outside a spool: the program keeps no log and no `LogEffect` (an effectful program
    dispatches on JAX's slow path). Such binds come from jaxprs a library captured under a
    spool and evaluates later (Equinox's checkpointed loops re-run their body in the
    backward pass), and from custom derivative rules JAX traces after the spool returned."""

    multiple_results = True

    def bind(self, *args, **params):
        if _compat.logging_enabled.value:
            return super().bind(*args, **params)
        _dropped(params["site"], params["rule"])
        return []


def _dropped(site: str, rule: str | None) -> None:
    if rule is not None:
        warnings.warn(_lost_message(site, rule), LostEventsWarning, stacklevel=3)


log_p = _LogPrimitive("eqx_logs.log")


@log_p.def_effectful_abstract_eval
def _log_abstract_eval(*avals, **params):
    del avals, params
    return [], {log_effect}


@log_p.def_impl
def _log_impl(*args, site, rule, **params):
    del args, params
    if rule is not None:
        warnings.warn(_lost_message(site, rule), LostEventsWarning, stacklevel=2)
        return []
    raise RuntimeError(
        f"eqx_logs.log at {site} was evaluated eagerly while a spool or tap was tracing (for "
        "example under `jax.ensure_compile_time_eval`). Its value cannot be captured there: "
        "log traced values, outside `ensure_compile_time_eval`."
    )


def _log_jvp(primals, tangents, **params):
    del tangents
    log_p.bind(*primals, **params)  # primal values only, once
    return [], []


def _leading(x: Any, dim: Any, size: int) -> Any:
    """`x` with its batch axis `dim` first, or broadcast along a new one if unbatched. `x` is
    any operand a primitive takes: an array, a tracer or a Python scalar (a jaxpr literal's
    value, as an interpreter reads it: on jax 0.10 a `TypedFloat`, with no `.shape`)."""
    if dim is _compat.not_mapped:
        return jnp.broadcast_to(x, (size, *jnp.shape(x)))
    return x if dim == 0 else jnp.moveaxis(x, dim, 0)


def _log_batch(axis_data, args, dims, *, treedef, nbatch, axis_names, **params):
    """A key whose leaves (and the call's steps and mask) are all unbatched stays unbatched;
    the others get a leading batch axis, unbatched leaves broadcast. So a key's layout does
    not depend on the keys logged in the same call."""
    size = _compat.axis_size_and_name(axis_data)[0]  # (called even if nothing is batched)
    name = _compat.user_axis_name(axis_data)
    n_leaves = treedef.num_leaves
    mapped = [d is not _compat.not_mapped for d in dims]
    shared = any(mapped[n_leaves:])  # steps and mask
    positions = jtu.tree_unflatten(treedef, list(range(n_leaves)))
    batched = {
        k: shared or any(mapped[i] for i in jtu.tree_leaves(v)) for k, v in positions.items()
    }
    rest = list(range(n_leaves, len(args)))
    for want in (False, True):
        keys = {k: v for k, v in positions.items() if batched[k] == want}
        if not keys:
            continue
        leaves, sub = jtu.tree_flatten(keys)
        ops = [args[i] for i in [*leaves, *rest]]
        if not want:
            log_p.bind(*ops, treedef=sub, nbatch=nbatch, axis_names=axis_names, **params)
            continue
        moved = [_leading(a, dims[i], size) for a, i in zip(ops, [*leaves, *rest])]
        names = (name, *axis_names)
        log_p.bind(*moved, treedef=sub, nbatch=nbatch + 1, axis_names=names, **params)
    return [], []


def _log_transpose(cts, *args, **params):
    """A log inside a function JAX transposes (the `matvec` of `lax.custom_linear_solve`, whose
    transpose is a derived `vecmat`) contributes no cotangent; the transposed function, which
    the user did not write, does not log."""
    del cts, params
    return [None] * len(args)


_compat.def_jvp(log_p, _log_jvp)
_compat.def_primal_only(log_p)  # `_log_jvp` without tracing it at every bind under grad
_compat.def_transpose(log_p, _log_transpose)
_compat.def_batching_with_axis(log_p, _log_batch)
_compat.keep_in_loops(log_p, LogEffect)


def _log_lowering(*args, site, rule, **params):
    """A log that reaches compilation was traced with logging on but never consumed by a
    spool or tap interpreter (so it is outside every spool): it does nothing, like `log`
    outside a spool. A custom rule's backward pass is the one way this loses events."""
    del args, params
    if rule is not None:
        warnings.warn(_lost_message(site, rule), LostEventsWarning, stacklevel=2)
    return []


_compat.def_lowering(log_p, _log_lowering)


def is_log(eqn: _compat.JaxprEqn) -> bool:
    return eqn.primitive is log_p


def rebind(
    eqn: _compat.JaxprEqn,
    invals: list[Any],
    mask: Any = None,
    *,
    keys: list[str] | None = None,
    rule: str | None = None,
    branch: tuple[int, int] | None = None,
) -> None:
    """Bind a log equation again (for an enclosing spool or tap): only `keys` of it (None:
    all), its events masked by `mask` too (a bool per lane; None: as they were), marked as
    coming from the backward or forward `rule` of a custom derivative (None: as it was), and
    as in `branch`, `(cond, branch index)`, of a batched cond (None: as it was).
    Where no spool or tap is tracing, the events are dropped (see `log_p`), and operands
    computed only for logs (`Lazy`) are never computed."""
    params = dict(eqn.params)
    if not _compat.logging_enabled.value:
        _dropped(params["site"], rule or params["rule"])
        return
    invals = force(invals)
    if mask is None and keys is None and rule is None and branch is None:
        _compat.bind_eqn(eqn, invals)
        return
    treedef, n_steps = params["treedef"], len(params["steps"])
    items = jtu.tree_unflatten(treedef, invals[: treedef.num_leaves])
    if keys is not None:
        items = {k: items[k] for k in keys}
    leaves, params["treedef"] = jtu.tree_flatten(items)
    rest = invals[treedef.num_leaves :]
    steps, old = rest[:n_steps], rest[n_steps:]
    if mask is not None:
        mask = jnp.logical_and(old[0], mask) if params["masked"] else mask
        old, params["masked"] = [jnp.asarray(mask, bool)], True
    if rule is not None:
        params["rule"] = rule
    if branch is not None:
        params["branches"] = tuple(sorted((*params["branches"], branch)))
    log_p.bind(*leaves, *steps, *old, **params)


# ----------------------------------------------------------------------------------------
# Scopes and call sites.
# ----------------------------------------------------------------------------------------

_local = threading.local()
_package_dir = os.path.dirname(os.path.abspath(__file__))


def _scopes() -> list[str]:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


@contextlib.contextmanager
def scope(name: str | None = None, /, **steps: int | ArrayLike) -> Iterator[None]:
    """Prefix every key logged inside the block with `name/`, and record `steps` with every
    event inside it. Scopes nest.

    **Arguments:**

    - `name`: a non-empty string without leading or trailing `/`; or None for no prefix.
    - `**steps`: integer scalars recorded beside every event logged inside the block (as
        `log(..., step=i)` does), also those of `instrument`, `log_stats`, `sow` and the
        backward pass of `log_grad` traced inside it; a step the `log` call names itself
        wins. Enter it where the step is a traced value (inside the jitted training step,
        around the model's call): a Python number would be a constant of the compiled program.

    !!! example

        ```python
        with eqx_logs.scope("encoder"):
            eqx_logs.log("norm", x)  # logged as "encoder/norm"

        with eqx_logs.scope(step=i):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(instrumented_model, x)
        ```

    The prefix is applied when `log` is called (when the function is traced), so it is the
    same on every retrace: no counters are involved.
    """
    site = _call_site()
    if name is not None and (not isinstance(name, str) or not name or name.strip("/") != name):
        raise ValueError(
            f"eqx_logs.scope(name) needs a non-empty string without leading or trailing '/' "
            f"(or None), got {name!r}."
        )
    checked = {n: _check_step(n, v, site) for n, v in steps.items()}
    if checked and not _compat.tracing():
        raise ValueError(
            f"eqx_logs.scope({', '.join(f'{n}=...' for n in steps)}) at {site} is entered "
            "outside any jit or trace: its steps would be constants of the programs compiled "
            "inside it, one program per value. Enter it inside the jitted function, with the "
            "step as a traced argument (or log `step=` at each `log` call)."
        )
    prefixes, context = _scopes(), _context_steps()
    if name is not None:
        prefixes.append(name)
    # in trace-cache keys: a traced value by identity (a jit traced inside this block is traced
    # again inside the next, so it never holds an old trace's value), a number by value
    key = tuple((n, _Traced() if _compat.is_tracer(v) else int(v)) for n, v in checked.items())
    context.append((checked, key))
    try:
        with tracing_context():
            yield
    finally:
        context.pop()
        if name is not None:
            prefixes.pop()


def _context_steps() -> list[tuple[dict[str, Any], tuple]]:
    if not hasattr(_local, "steps"):
        _local.steps = []
    return _local.steps


def current_steps() -> dict[str, Any]:
    """The steps of the enclosing `scope` blocks (inner ones win)."""
    merged: dict[str, Any] = {}
    for steps, _ in _context_steps():
        merged.update(steps)
    return merged


class _Traced:
    """A traced step's place in a trace-cache key: equal only to itself."""

    __slots__ = ()


def _context_key() -> tuple:
    return tuple(key for _, key in _context_steps() if key)


def current_prefix() -> str:
    return "/".join(_scopes())


@contextlib.contextmanager
def logging_as(
    prefix: str, rule: str | None = None, *, enabled: bool | None = True
) -> Iterator[None]:
    """Logging on (or as it is, for `enabled=None`), under the scope `prefix` (a function JAX
    traces later, such as a custom derivative rule, logs as where it was written). `rule`
    names the custom rule whose events pass on: they are lost, with a `LostEventsWarning`,
    if no spool or tap captures them."""
    scopes, old_rule = _scopes(), getattr(_local, "rule", None)
    saved = list(scopes)
    scopes[:] = prefix.split("/") if prefix else []
    _local.rule = rule
    try:
        with _no_context_steps(), tracing_context(enabled=enabled):
            yield
    finally:
        scopes[:] = saved
        _local.rule = old_rule


@contextlib.contextmanager
def tracing_context(enabled: bool | None = None) -> Iterator[None]:
    """Sets the JAX config states that `log` depends on at trace time (logging on or off, and
    the scope prefix while on), so that JAX's trace caches tell the cases apart."""
    with contextlib.ExitStack() as stack:
        if enabled is not None:
            stack.enter_context(_compat.logging_enabled(enabled))
        if _compat.logging_enabled.value:
            context = _context_key()
            prefix = (current_prefix(), context) if context else current_prefix()
            stack.enter_context(_compat.scope_prefix(prefix))
        yield


_contextlib_file = contextlib.__file__


def _call_site() -> str:
    """The user's file:line (function) that called into eqx_logs (a `with` statement, for
    `scope`)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename == _contextlib_file
        or os.path.dirname(os.path.abspath(frame.f_code.co_filename)).startswith(_package_dir)
    ):
        frame = frame.f_back
    if frame is None:
        return "<unknown location>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


# ----------------------------------------------------------------------------------------
# log
# ----------------------------------------------------------------------------------------


class _Missing:
    """`log`'s second argument when none is given: `log(data)`, not `log(name, value)`. Its
    repr, `MISSING`, is what signatures show (`help(log)`, the API reference)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


_MISSING = _Missing()
# Attributes of LogDict that a step name would shadow.
# LogDict's attributes, and the fields of a logger's records (`loggers.records`)
RESERVED_STEP_NAMES = frozenset({"count", "steps", "reductions", "rows", "key", "value", "run"})


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex)


def _check_value(key: str, value: Any, site: str) -> list[Any]:
    try:
        leaves = jtu.tree_leaves(value)
    except (ValueError, TypeError, RecursionError, SystemError) as e:  # JAX's own pytree errors
        raise TypeError(
            f"eqx_logs.log: key {key!r} at {site} has a value that is not a valid pytree "
            f"({type(e).__name__}: {str(e)[:200]}): log a dict with keys of one type, nested "
            "at most a few hundred levels deep."
        ) from None
    if not leaves:
        raise ValueError(
            f"eqx_logs.log: key {key!r} at {site} has no array in its value {value!r}."
        )
    for leaf in leaves:
        if not _is_arraylike(leaf):
            raise TypeError(
                f"eqx_logs.log: key {key!r} at {site} has a value of type "
                f"{type(leaf).__name__} ({leaf!r:.60}); only arrays, numpy arrays and Python "
                "numbers can be logged (log a number that encodes it, or put strings in tags)."
            )
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"eqx_logs.log: key {key!r} at {site} is a typed PRNG key; log "
                "`jax.random.key_data(key)` instead."
            )
        if isinstance(leaf, np.ndarray | np.generic) and leaf.dtype.kind in "OSUVMm":
            raise TypeError(
                f"eqx_logs.log: key {key!r} at {site} has a numpy array of dtype {leaf.dtype}; "
                "only numbers (bool, int, float, complex) can be logged."
            )
        _check_range(f"key {key!r}", leaf, site)
    return leaves


def _check_range(what: str, x: Any, site: str) -> None:
    """A Python or numpy integer must fit the integer type JAX gives it (int32 without
    `jax_enable_x64`): JAX would otherwise wrap it silently (2**40 + 7 becomes 7)."""
    if isinstance(x, bool) or not isinstance(x, int | np.integer | np.ndarray):
        return
    if isinstance(x, np.ndarray) and (x.dtype.kind not in "iu" or x.size == 0):
        return
    dtype = jnp.int64 if isinstance(x, int) else np.asarray(x).dtype
    target = jnp.iinfo(jax.dtypes.canonicalize_dtype(dtype))
    lo, hi = (int(np.min(x)), int(np.max(x))) if isinstance(x, np.ndarray) else (int(x), int(x))
    if lo < target.min or hi > target.max:
        raise OverflowError(
            f"eqx_logs.log: {what} at {site} holds {hi if hi > target.max else lo}, outside "
            f"{target.dtype} (the type JAX gives it here, and would wrap it to); enable "
            "`jax_enable_x64`, or log a float."
        )


def _check_step(name: str, value: Any, site: str) -> jax.Array:
    if name in RESERVED_STEP_NAMES:
        raise ValueError(
            f"eqx_logs.log: step name {name!r} at {site} is reserved by LogDict and the "
            f"loggers' records ({sorted(RESERVED_STEP_NAMES)}); choose another name such as "
            "'iteration'."
        )
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and isinstance(value, jax.Array | np.ndarray | np.generic):
        ok = jnp.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value), jnp.integer)
    if not ok:
        raise TypeError(
            f"eqx_logs.log: step {name}={value!r:.60} at {site} must be an integer scalar "
            "(a Python int or an integer array of shape ()), for example `step=i`. Keyword "
            f"arguments are step names; to log {name!r} as a value, pass it in the dict: "
            f"log({{{name!r}: ...}})."
        )
    _check_range(f"step {name!r}", value, site)
    return jnp.asarray(value)


def _check_reduce(reduce: Any, site: str) -> None:
    as_reduction(reduce, where=f"eqx_logs.log at {site}: reduce")
    try:
        hash(reduce)
    except TypeError:
        raise TypeError(
            f"eqx_logs.log at {site}: reduce={reduce!r} must be hashable (it is recorded when "
            "tracing); pass array fields such as a Sample key to spool instead."
        ) from None


def _normalise_tags(tags: Any, site: str) -> tuple[str, ...]:
    try:
        out = (tags,) if isinstance(tags, str) else tuple(tags)
    except TypeError:
        out = None
    if out is None or not all(isinstance(t, str) for t in out):
        raise TypeError(
            f"eqx_logs.log: tags at {site} must be a string or a tuple of strings, such as "
            f"tags='train' or tags=('train', 'debug'); got {tags!r}."
        )
    return out


def log(
    data: dict[str, PyTree[ArrayLike]] | str | None = None,
    value: PyTree[ArrayLike] = _MISSING,
    /,
    *,
    tags: str | tuple[str, ...] = (),
    reduce: Any = None,
    **steps: int | ArrayLike,
) -> None:
    """Log values from anywhere: a model, a scan body, a cond branch, a vmapped function.

    **Arguments:**

    - `data`: a dict from key (a string) to value (a pytree of arrays or Python numbers); or a
        key, with the value as the second argument: `log("loss", loss)`.
    - `tags`: strings that spool's and tap's `tags=`/`exclude=` filters select on.
    - `reduce`: the reduction for these keys, a name (`"mean"`) or a reduction; used unless a
        spool's Policy rule matches the key. Two sites naming different reductions for one key
        is an error.
    - `**steps`: named integer scalars recorded beside every key of this call, for example
        `step=i, episode=e`; read back as `logs.step[key]`, `logs.episode[key]`.

    **Returns:**

    None. Outside any `spool` or `tap` this does nothing and adds nothing to compiled code.

    !!! example

        ```python
        def f(x):
            eqx_logs.log({"x": x, "x2": x**2}, step=0)
            return x + 1

        out, logs = eqx_logs.spool(f)(1.0)  # logs["x"] == [1.0], logs.step["x"] == [0]
        ```
    """
    site = _call_site()
    if data is None:  # `log(loss=x)`: a value passed as a step
        names = ", ".join(f"{k}=..." for k in steps)
        example = next(iter(steps), "loss")
        raise TypeError(
            f"eqx_logs.log({names}) at {site} logs no value: keyword arguments are step names "
            f"(step=i), recorded beside the values. Log a value as "
            f"log({{{example!r}: x}}) or log({example!r}, x)."
        )
    if value is not _MISSING:
        if not isinstance(data, str):
            raise TypeError(
                f"eqx_logs.log(name, value) at {site} needs a string name, got "
                f"{type(data).__name__}; use log({{name: value}}) for several keys."
            )
        data = {data: value}
    elif not isinstance(data, dict):
        raise TypeError(
            f"eqx_logs.log at {site} takes a dict from key to value, or a name and a value; "
            f"got {type(data).__name__}."
        )
    if reduce is not None:
        _check_reduce(reduce, site)
    tags = _normalise_tags(tags, site)
    prefix = current_prefix()
    items = {}
    for key, val in data.items():
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"eqx_logs.log at {site}: keys must be non-empty strings known when tracing, "
                f"got {key!r} of type {type(key).__name__}."
            )
        _check_value(key, val, site)
        items[f"{prefix}/{key}" if prefix else key] = val
    step_vals = {name: _check_step(name, s, site) for name, s in steps.items()}
    if not _compat.logging_enabled.value:
        _dropped(site, getattr(_local, "rule", None))  # a custom rule's, traced too late
        return None
    bind(items, step_vals, tags=tags, reduce=reduce, site=site)


def bind(
    items: dict[str, Any],
    steps: dict[str, Any],
    *,
    tags: tuple[str, ...] = (),
    reduce: Any = None,
    site: str,
    statistics: bool = False,
) -> None:
    """Bind `log_p` for already-validated, already-scoped `items`, with the steps of the
    enclosing `scope` blocks. `statistics`: the items are statistics of arrays
    (`"<where>/<stat>"`, see `_stats.py`), not the values the user logged."""
    steps = {**current_steps(), **steps}
    leaves, treedef = jtu.tree_flatten(items)
    names = tuple(sorted(steps))
    operands = [jnp.asarray(x) for x in leaves] + [jnp.asarray(steps[n]) for n in names]
    log_p.bind(
        *operands,
        treedef=treedef,
        steps=names,
        tags=tags,
        reduce=reduce,
        site=site,
        rule=getattr(_local, "rule", None),
        nbatch=0,
        axis_names=(),
        masked=False,
        branches=(),
        statistics=statistics,
    )


# ----------------------------------------------------------------------------------------
# log_grad
# ----------------------------------------------------------------------------------------


BACKWARD_TAG = "backward"  # on the events logged in the backward pass


def grad_tap(
    items_of: Callable[[Any], dict[str, Any]], site: str, x: Any, tags: tuple[str, ...] = ()
) -> Any:
    """Identity on `x`; in the backward pass, logs `items_of(cotangent)`, tagged
    `BACKWARD_TAG` and `tags` (those of the forward events it belongs with), with the steps of
    the `scope` blocks around this call. `items_of` must be hashable (JAX keys its traces on
    it)."""
    return _grad_tap(items_of, site, (BACKWARD_TAG, *tags), x, current_steps())


# The steps travel as residuals: JAX may trace the backward rule in a trace of its own (the
# transpose of an inner jit), where the traced values of the enclosing scopes do not exist.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grad_tap(items_of, site, tags, x, steps):
    return x


def _grad_tap_fwd(items_of, site, tags, x, steps):
    return x, steps


def _grad_tap_bwd(items_of, site, tags, steps, ct):
    if _compat.logging_enabled.value:
        with _no_context_steps():
            bind(items_of(ct), steps, tags=tags, site=site, statistics=items_of.statistics)
    zeros = jtu.tree_map(lambda s: np.zeros(np.shape(s), jax.dtypes.float0), steps)
    return ct, zeros


_grad_tap.defvjp(_grad_tap_fwd, _grad_tap_bwd)


@contextlib.contextmanager
def _no_context_steps() -> Iterator[None]:
    """Without the steps of the `scope` blocks around: in a function JAX traces apart (a
    custom derivative rule), whose events carry what was captured where it was called."""
    saved = list(_context_steps())
    _context_steps().clear()
    try:
        yield
    finally:
        _context_steps()[:] = saved


@dataclasses.dataclass(frozen=True)
class _Cotangent:
    key: str
    statistics = False  # its items are cotangents, not statistics of them

    def __call__(self, ct: Any) -> dict[str, Any]:
        return {self.key: ct}


def log_grad(name: str, x: PyTree[ArrayLike]) -> PyTree[ArrayLike]:
    """Identity on `x`; in the backward pass, logs the cotangent of `x` under `name`.

    **Arguments:**

    - `name`: the key (scopes apply, as for `log`).
    - `x`: a pytree of floating-point arrays.

    **Returns:**

    `x`, unchanged.

    !!! example

        ```python
        def loss(w, x):
            h = eqx_logs.log_grad("dh", jnp.tanh(w * x))
            return jnp.sum(h**2)

        g, logs = eqx_logs.spool(jax.grad(loss))(w, x)  # logs["dh"][0] == d loss / d h
        ```
    """
    site = _call_site()
    if not isinstance(name, str) or not name:
        raise TypeError(f"eqx_logs.log_grad at {site} needs a non-empty string name, got {name!r}.")
    _check_value(name, x, site)
    if not _compat.logging_enabled.value:
        return x
    prefix = current_prefix()
    return grad_tap(_Cotangent(f"{prefix}/{name}" if prefix else name), site, x)


# ----------------------------------------------------------------------------------------
# sow: a logged value that `plant` may replace
# ----------------------------------------------------------------------------------------

# Identity on its operands (the leaves of one sown value), `nbatch` leading batch axes; the
# value it returns is logged after it, so that a spool records what the program goes on with.
sow_p = _compat.Primitive("eqx_logs.sow")
sow_p.multiple_results = True
sow_p.def_impl(lambda *xs, key, nbatch: list(xs))
sow_p.def_abstract_eval(lambda *avals, key, nbatch: list(avals))


def _sow_jvp(primals, tangents, *, key, nbatch):
    # tangents pass straight through: `jax.grad(plant(f, values))` differentiates a planted
    # value as the constant it is, since plant replaces the primitive before JAX sees it
    return sow_p.bind(*primals, key=key, nbatch=nbatch), list(tangents)


def _sow_batch(axis_data, args, dims, *, key, nbatch):
    size = _compat.axis_size_and_name(axis_data)[0]
    moved = [_leading(x, d, size) for x, d in zip(args, dims)]
    return sow_p.bind(*moved, key=key, nbatch=nbatch + 1), [0] * len(args)


_compat.def_jvp(sow_p, _sow_jvp)
_compat.def_batching_with_axis(sow_p, _sow_batch)
_compat.def_lowering(sow_p, lambda *xs, key, nbatch: list(xs))


def is_sow(eqn: _compat.JaxprEqn) -> bool:
    return eqn.primitive is sow_p
