"""Parameter initialisation shared by the cells."""

import jax
import jax.numpy as jnp
import numpy as np


def floating(dtype):
    """`dtype`, or the default floating dtype (float64 under `jax_enable_x64`)."""
    return jnp.result_type(float) if dtype is None else jnp.dtype(dtype)


def uniform(key, shape, bound, dtype):
    """Uniform on `[-bound, bound]`."""
    return jax.random.uniform(key, shape, dtype, minval=-bound, maxval=bound)


def check_sizes(owner: str, **sizes):
    """Raises a `ValueError` naming `owner` and the argument unless each size is an
    int >= 1."""
    for name, value in sizes.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, np.integer))
            or value < 1
        ):
            raise ValueError(
                f"pscan.nn.{owner}: `{name}` must be a positive int, got {value!r}"
            )
