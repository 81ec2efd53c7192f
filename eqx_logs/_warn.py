"""Warnings attributed to the user's line, not to eqx_logs, Equinox or JAX."""

import sys
import warnings

# Frames a warning is not attributed to: eqx_logs, and the Equinox and JAX machinery between
# the user's call and ours (`eqx.filter_jit` tracing a spooled function, a Module's method).
_INSIDE = ("eqx_logs.", "equinox.", "jax.", "jaxlib.", "contextlib")


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn`, attributed to the first frame outside eqx_logs, Equinox and JAX: the
    user's call."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
