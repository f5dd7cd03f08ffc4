"""Sequences as users have them: packed segments (`resets`) and right padding
(`length`), as per-step masks.

- `resets[t]` (time order, the start of a segment): step `t` starts from `h0` instead
    of the previous state. Running backward (`reverse=True`), each segment runs from its
    last step down to its first, so the step that starts from `h0` is the one *before*
    a segment start in time: the masks read `resets[t + 1]`.
- `length`: steps `t >= length` leave the state unchanged (they are the identity), so
    the state after the last real step is carried to the end; running backward, `h0` is
    carried through the padding to step `length - 1`, where the backward pass starts.

Both are value-level masks, so they are traced (one compiled program for every layout
and length, and `jax.vmap` over a batch of them).
"""

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from ._axis import shift_backward


def segment_masks(
    owner: str,
    steps: int,
    resets: Bool[ArrayLike, " T"] | None,
    length: Int[ArrayLike, ""] | None,
    *,
    reverse: bool = False,
    axis_name: str | None = None,
) -> tuple[Bool[Array, " T"] | None, Bool[Array, " T"] | None]:
    """`(restart, valid)`: per step, whether it starts from `h0`, and whether it is a
    real step (None where the argument is None).

    **Arguments:**

    - `owner`: the public function, for error messages.
    - `steps`: `T`, the number of steps (of this device's block with `axis_name`).
    - `resets`: None, or a boolean array `(T,)`: segment starts, in time order.
    - `length`: None, or an integer scalar (traced or not): steps at and after it
        are padding.
    - `reverse`: whether the recurrence runs backward.
    - `axis_name`: inside `shard_map`, the mesh axis that splits time (this device
        holds a block of `steps` consecutive steps).

    **Returns:**

    `(restart, valid)`, boolean `(T,)` arrays in time order, or None.

    **Raises:**

    `ValueError` when `resets` is not a boolean `(T,)` array or `length` not an integer
    scalar.
    """
    restart = valid = None
    resets, length = check_segments(owner, steps, resets, length)
    if resets is not None:
        restart = resets
        if reverse:  # step t starts from h0 when a segment starts at t + 1
            restart = shift_backward(resets.astype(jnp.int8), axis_name) > 0
    if length is not None:
        t = jnp.arange(steps)
        if axis_name is not None:
            t = t + lax.axis_index(axis_name) * steps
        valid = t < length
    return restart, valid


def check_segments(
    owner: str,
    steps: int,
    resets: Bool[ArrayLike, " T"] | None,
    length: Int[ArrayLike, ""] | None,
) -> tuple[Bool[Array, " T"] | None, Int[Array, ""] | None]:
    """`(resets, length)` as arrays (None stays None), or a `ValueError` naming
    `pscan.{owner}` when `resets` is not a boolean `(steps,)` array or `length` not
    an integer scalar."""
    if resets is not None:
        resets = jnp.asarray(resets)
        if resets.shape != (steps,) or resets.dtype != jnp.bool_:
            raise ValueError(
                f"pscan.{owner}: `resets` must be a boolean array of shape ({steps},) "
                f"(one flag per step), got shape {resets.shape} and dtype {resets.dtype}"
            )
    if length is not None:
        length = jnp.asarray(length)
        if length.ndim != 0 or not jnp.issubdtype(length.dtype, jnp.integer):
            batch = (
                "; lengths of a batch: jax.vmap over them" if length.ndim == 1 else ""
            )
            raise ValueError(
                f"pscan.{owner}: `length` must be an integer scalar, the number of real "
                f"steps (traced values are fine{batch}), got shape {length.shape} and "
                f"dtype {length.dtype}"
            )
    return resets, length


def along_time(mask: Array, x: Array) -> Array:
    """A `(T,)` mask shaped to broadcast against `x` along its leading (time) axis."""
    return mask.reshape((-1,) + (1,) * (x.ndim - 1))
