"""Per-example gradient norms without per-example gradients. (Stub: helper C implements it.)"""


def value_grad_and_norms(loss_fn, **kwargs):
    """The mean loss, its gradient and each example's gradient norm (stub)."""
    raise NotImplementedError
