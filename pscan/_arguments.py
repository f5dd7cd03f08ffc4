"""Checks of the Python arguments that shape a program (flags, sizes): a `ValueError`
naming the function and the argument, at trace time."""

import jax
import jax.numpy as jnp
import numpy as np


def check_flag(owner: str, name: str, value) -> bool:
    """`value` as a Python bool, or a `ValueError` naming `owner.name` unless it is a
    Python or NumPy bool (a flag that shapes the program must be known when it is
    traced: not an array, and not a string or number that only looks like one)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (jax.Array, np.ndarray)):
        got = f"an array of shape {jnp.shape(value)} and dtype {jnp.result_type(value)}"
        hint = " (it decides the program's shape, so it cannot be traced)"
    else:
        got, hint = repr(value), ""
    raise ValueError(f"pscan.{owner}: `{name}` must be True or False{hint}, got {got}")


def check_positive_int(owner: str, name: str, value, allow_none: bool = False):
    """Raises a `ValueError` naming `owner.name` unless `value` is an int >= 1."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"pscan.{owner}: `{name}` must be a positive int, got {value!r}"
        )
