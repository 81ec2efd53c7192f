"""`log_noise_scale`: the gradient noise scale's event from per-example gradient norms and the
batch gradient. (Stub: helper D implements it.)"""


def log_noise_scale(name, norms, grads, **kwargs):
    """Log the gradient noise scale's terms (stub)."""
    raise NotImplementedError
