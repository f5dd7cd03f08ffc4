"""Parameter initialisation shared by the cells."""

import jax
import jax.numpy as jnp


def floating(dtype):
    """`dtype`, or the default floating dtype (float64 under `jax_enable_x64`)."""
    return jnp.result_type(float) if dtype is None else jnp.dtype(dtype)


def uniform(key, shape, bound, dtype):
    """Uniform on `[-bound, bound]`."""
    return jax.random.uniform(key, shape, dtype, minval=-bound, maxval=bound)
