"""A logger's state: the run it writes to."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int, PRNGKeyArray


class LoggerState(eqx.Module):
    """What `AbstractLogger.init` returns: the run this state writes to. Under `jax.vmap`
    over states each lane writes to its own run."""

    run: Int[Array, ""]


def run_index(key: PRNGKeyArray | ArrayLike | None) -> Int[Array, ""]:
    if key is None:
        return jnp.int32(0)
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.randint(key, (), 0, 2**31 - 1, dtype=jnp.int32)
    if key.dtype == jnp.uint32 and key.shape == (2,):  # a raw `jax.random.PRNGKey`
        return jax.random.randint(key, (), 0, 2**31 - 1, dtype=jnp.int32)
    if key.shape != () or not jnp.issubdtype(key.dtype, jnp.integer):
        raise TypeError(
            "logger.init(key) takes a jax.random.key, an integer run index or None; got an "
            f"array of shape {key.shape} and dtype {key.dtype}. For one run per seed use "
            "`jax.vmap(logger.init)(jax.random.split(key, n))`."
        )
    return key.astype(jnp.int32)
