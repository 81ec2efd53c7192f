"""NoiseScale: the gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model
of Large-Batch Training", appendix A), from gradient norms at two batch sizes, with moving
averages of its numerator and denominator."""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array

from .._checks import check_number
from ._reductions import EMA, AbstractReduction, _float_dtype

#: The keys of a NoiseScale event.
EVENT_KEYS = ("small", "big", "b_small", "b_big")
LANES = ("after", "mean")


def terms(small: Any, big: Any, b_small: Any, b_big: Any, dtype: Any) -> tuple[Array, Array]:
    """`(trace, grad_sq)` of one step, in `dtype`: the unbiased estimates of tr(Sigma) and
    |G|^2 from the squared gradient norms `small` and `big` at batch sizes `b_small < b_big`
    (NaN unless `1 <= b_small < b_big`)."""
    small, big = jnp.asarray(small, dtype), jnp.asarray(big, dtype)
    bs, bb = jnp.asarray(b_small, dtype), jnp.asarray(b_big, dtype)
    ok = (bs >= 1) & (bs < bb)
    gap = jnp.where(ok, bb - bs, jnp.ones((), dtype))
    nan = jnp.full((), jnp.nan, dtype)
    grad_sq = jnp.where(ok, (bb * big - bs * small) / gap, nan)
    # (small - big) / (1 / bs - 1 / bb), without the reciprocals
    trace = jnp.where(ok, (small - big) * (bs * bb / gap), nan)
    return trace, grad_sq


def check_sizes(b_small: Any, b_big: Any, where: str) -> None:
    """Raise `ValueError` naming `where` for batch sizes known when tracing (Python numbers,
    numpy values) with `b_small >= b_big` or `b_small < 1`; traced sizes are
    left to the reduction, which makes NaN of such an event."""
    if not all(_static(b) for b in (b_small, b_big)):
        return
    sizes = [np.asarray(b) for b in (b_small, b_big)]
    bs, bb = sizes
    if bs.size != 1 or bb.size != 1:
        return
    bs, bb = bs.item(), bb.item()
    if not bs >= 1 or not bb > bs:
        raise ValueError(
            f"{where}: the gradient noise scale needs 1 <= b_small < b_big, got "
            f"b_small={bs!r}, b_big={bb!r}. b_small is the batch size of each gradient whose "
            "squared norm is averaged into `small` (1 for per-example gradients, the "
            "micro-batch size for micro-batch gradients), b_big that of the batch gradient "
            "whose squared norm is `big` (the whole batch)."
        )


def _static(x: Any) -> bool:
    return isinstance(x, int | float | np.ndarray | np.generic) and not isinstance(x, bool)


class NoiseScale(AbstractReduction):
    """The gradient noise scale B_simple = tr(Sigma) / |G|^2 of McCandlish et al. 2018 ("An
    Empirical Model of Large-Batch Training", appendix A), from gradient norms measured at
    two batch sizes, with the numerator and the denominator each averaged over steps (a
    ratio of averages, not an average of ratios).

    Each event is a dict of scalars `{"small": |G_small|^2, "big": |G_big|^2, "b_small":
    B_small, "b_big": B_big}`: the mean squared norm of gradients over batches of `b_small`
    examples, and the squared norm of a gradient over `b_big > b_small` examples (the batch
    sizes may be Python ints or arrays). Each event gives the unbiased estimates

        grad_sq = (b_big * big - b_small * small) / (b_big - b_small)     (|G|^2)
        trace   = (small - big) / (1 / b_small - 1 / b_big)              (tr(Sigma))

    and the reduction keeps bias-corrected exponential moving averages of both, as
    [`EMA`][eqx_logs.EMA] does. From per-example gradients, `b_small = 1`, `small` is the
    mean of `||g_i||^2` and `big = ||mean_i g_i||^2` with `b_big` the batch size:
    [`eqx_logs.log_noise_scale`][] makes that event. An event without `1 <= b_small < b_big`
    known only on the device makes both averages NaN (from then on); `log_noise_scale` raises for
    sizes known when tracing.

    The output is `{"b_simple": trace / grad_sq, "trace": ..., "grad_sq": ...}`, of the moving
    averages, in Mean's dtype of `small` and `big` (never narrower than float32); NaN with no
    events. B_simple is noisy (and may be negative) until the averages settle: with
    `decay=0.99`, over about a hundred steps.

    **Arguments:**

    - `decay`: of the moving averages, in [0, 1); may be an array (changing it does not
        recompile). 0 keeps only the last step's estimate.
    - `lanes`: how [`across=`][eqx_logs.Policy(across)] merges devices or vmap lanes
        (`merge`):
        - `"after"` (the default): as every reduction's merge, the events of one device after
            those of the one before (EMA's merge): device 1's steps come after device 0's, and
            the averages weigh the last device's steps most.
        - `"mean"`: the devices' (lanes') averages averaged, each device with events weighing
            the same: for data-parallel devices that each log their own micro-batch's terms
            at the same steps, the moving average of the per-step mean over devices of the
            estimates, i.e. of those from the devices' `small` and `big` averaged per step
            (with the same batch sizes on every device; the estimates are linear in `small`
            and `big`). This is what a data-parallel run wants, but is not the events of
            one device followed by another's.

        Where every device logs the same event (`log_noise_scale(..., axis_name=...)`
        averages the terms over the devices first), both give that event's averages.

    !!! example

        ```python
        def step(c, k):
            g = 1.0 + jax.random.normal(k, (64, 3))  # 64 per-example gradients
            small = jnp.mean(jnp.sum(g**2, axis=1))
            big = jnp.sum(jnp.mean(g, axis=0) ** 2)
            event = {"small": small, "big": big, "b_small": 1, "b_big": 64}
            eqx_logs.log("noise", event, reduce=eqx_logs.NoiseScale(0.9))
            return c, None

        keys = jax.random.split(jax.random.key(0), 50)
        _, logs = eqx_logs.spool(lambda: jax.lax.scan(step, 0, keys))()
        print(logs["noise"]["b_simple"])  # near tr(Sigma) / |G|^2 = 3 / 3 = 1
        ```
    """

    decay: float | Array = 0.99
    lanes: Literal["after", "mean"] = eqx.field(default="after", static=True)

    def __check_init__(self):
        if not isinstance(self.decay, jax.Array | np.ndarray | np.generic):
            check_number("NoiseScale", "decay", self.decay)
        if isinstance(self.decay, int | float) and not 0 <= self.decay < 1:
            raise ValueError(
                f"NoiseScale(decay={self.decay!r}): decay must be in [0, 1): the weight of "
                "the previous steps in the moving averages of tr(Sigma) and |G|^2 "
                "(0.99 averages over about 100 steps; 0 keeps the last step alone)."
            )
        if self.lanes not in LANES:
            raise ValueError(
                f"NoiseScale(lanes={self.lanes!r}): lanes must be 'after' (across= takes "
                "each device's steps after the one before's, as EMA's merge) or 'mean' "
                "(across= averages the devices' moving averages: data-parallel devices at "
                "the same steps)."
            )

    def _ema(self) -> EMA:
        return EMA(self.decay)

    def init(self, struct, max_events):
        _check_struct(struct)
        dtype = _float_dtype(jnp.result_type(struct["small"].dtype, struct["big"].dtype))
        scalar = jax.ShapeDtypeStruct((), dtype)
        ema = EMA.init(self._ema(), {"trace": scalar, "grad_sq": scalar}, max_events)
        return {**ema, "lanes": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        # sizes known when tracing (a `log` with Python ints): an error now, not NaN later
        check_sizes(
            value["b_small"],
            value["b_big"],
            "eqx_logs.NoiseScale (an event of a key logged with reduce=NoiseScale())",
        )
        dtype = state["total"]["trace"].dtype
        trace, grad_sq = terms(
            value["small"], value["big"], value["b_small"], value["b_big"], dtype
        )
        ema = {"total": state["total"], "weight": state["weight"]}
        ema = EMA.update(self._ema(), ema, {"trace": trace, "grad_sq": grad_sq}, valid)
        lanes = jnp.maximum(state["lanes"], jnp.asarray(valid, jnp.int32))
        return {**ema, "lanes": lanes}

    def merge(self, a, b):
        if self.lanes == "after":  # ("lanes" only says whether a state has events)
            ema = EMA.merge(self._ema(), _ema_part(a), _ema_part(b))
            return {**ema, "lanes": jnp.maximum(a["lanes"], b["lanes"])}
        # "mean": each lane with events weighs the same (a merged state weighs its lanes)
        la, lb = a["lanes"], b["lanes"]
        lanes = la + lb
        share = lb.astype(jnp.float32) / jnp.maximum(lanes, 1).astype(jnp.float32)

        def mean(x, y):
            s = share.astype(x.dtype)
            return x + (y - x) * s

        ema = jtu.tree_map(mean, _ema_part(a), _ema_part(b))
        return {**ema, "lanes": lanes}

    def finalize(self, state):
        out = EMA.finalize(self._ema(), _ema_part(state))
        trace, grad_sq = out["trace"], out["grad_sq"]
        return {"b_simple": trace / grad_sq, "trace": trace, "grad_sq": grad_sq}


def _ema_part(state: dict) -> dict:
    return {"total": state["total"], "weight": state["weight"]}


def _check_struct(struct: Any) -> None:
    """The events must be dicts of the four scalars (`EVENT_KEYS`), `small` and `big` real."""
    if not isinstance(struct, dict) or set(struct) != set(EVENT_KEYS):
        got = sorted(struct) if isinstance(struct, dict) else type(struct).__name__
        raise ValueError(
            f"NoiseScale: an event must be a dict with the keys {list(EVENT_KEYS)} (squared "
            f"gradient norms at two batch sizes, and the sizes), got {got}. Log it as "
            "log(name, {'small': ..., 'big': ..., 'b_small': 1, 'b_big': batch}, "
            "reduce=NoiseScale()), or use eqx_logs.log_noise_scale(name, norms, grads)."
        )
    for name in EVENT_KEYS:
        s = struct[name]
        if getattr(s, "shape", None) != ():
            raise ValueError(
                f"NoiseScale: the event's {name!r} must be a scalar, got shape "
                f"{getattr(s, 'shape', None)} (one event per step; under vmap, per lane)."
            )
        if name in ("small", "big") and jnp.issubdtype(s.dtype, jnp.complexfloating):
            raise TypeError(
                f"NoiseScale: the event's {name!r} is a squared norm, a real number; got "
                f"dtype {s.dtype}."
            )
