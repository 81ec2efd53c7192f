"""The whole suite runs as Equinox's own does, and as many of its users do: with strict dtype
promotion (`jax_numpy_dtype_promotion="strict"`: no implicit promotion between different
dtypes, Python scalars aside) and rank promotion raising (`jax_numpy_rank_promotion="raise"`:
no implicit broadcasting between different ranks). Library code must cast explicitly.

The environment variables carry the same settings into the subprocesses that tests start
(examples, Hydra runs, multi-device and multi-process checks): JAX reads them at import.
"""

import os

os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def standard_promotion():
    """Standard dtype promotion for one test, for third-party code that relies on it: optax's
    Adam computes `decay ** count` with an int32 count (`optax.tree.bias_correction`)."""
    with jax.numpy_dtype_promotion("standard"):
        yield
