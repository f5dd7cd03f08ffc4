"""Everything that knows about a mesh axis: the ground floor of sequence parallelism.

Inside `shard_map` every device holds a block of consecutive steps. Two things follow:

- values cross device boundaries (`shift_forward`, `shift_backward`, `everywhere`);
- `jax.shard_map` with its variance checks on (the default) types every value as varying
  across the axis or not, and a loop carry must be typed like what the loop adds to it
  (`like_inputs`, `varying`, `varies`).

Every helper is the identity (or a plain shift) when `axis_name` is None.
"""

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from ._chunking import shift_in


def like_inputs(x: Array, b: Array, axis: int = 0) -> Array:
    """`x` (shaped like one step of `b` along `axis`), typed to vary across devices as
    `b` does; the value is unchanged (adds zeros)."""
    return x + jnp.zeros_like(lax.index_in_dim(b, 0, axis, keepdims=False))


def varying(x: Array, axis_name: str | None) -> Array:
    """`x`, typed as varying across `axis_name` (for values that have no input of their
    shape to borrow a type from)."""
    if axis_name is None:
        return x
    return lax.pcast(x, (axis_name,), to="varying")


def varies(x: Array, axis_name: str) -> bool:
    """Whether `x` is typed as varying across `axis_name`: only when `shard_map` tracks
    variance (`jax.shard_map` with `check_vma=True`)."""
    return axis_name in jax.typeof(x).manual_axis_type.varying


def zeros_typed_like(aval, axis_name: str | None) -> Array:
    """Zeros of `aval`'s shape and dtype (an array or a `jax.ShapeDtypeStruct`), typed
    as varying across `axis_name` where `aval` is (inside `shard_map` with its
    variance checks on)."""
    zeros = jnp.zeros(aval.shape, aval.dtype)
    manual = getattr(aval, "manual_axis_type", None)
    if axis_name is not None and axis_name in getattr(manual, "varying", ()):
        zeros = varying(zeros, axis_name)
    return zeros


def global_rows(count: int, axis_name: str | None) -> tuple[Array, int | Array]:
    """For `count` consecutive rows on each device of `axis_name` (chunks, in device
    order): the indices of this device's rows in the whole sequence, and how many
    rows all the devices hold."""
    if axis_name is None:
        return jnp.arange(count), count
    first = lax.axis_index(axis_name) * count
    return first + jnp.arange(count), count * lax.axis_size(axis_name)


def everywhere(x: Array, axis_name: str | None, reduce) -> Array:
    """`x` reduced over the devices of `axis_name` with `reduce` (e.g. `lax.pmax`)."""
    return x if axis_name is None else reduce(x, axis_name)


def shift_forward(ends: Array, h0: Array, axis_name: str | None) -> Array:
    """The chunk starts that chunk ends imply: `[h0, ends[0], ..., ends[K-2]]`; with
    `axis_name`, a device's first start is the previous device's last end."""
    if axis_name is None:
        return shift_in(ends, h0)
    last = lax.all_gather(ends[-1], axis_name)
    i = lax.axis_index(axis_name)
    incoming = jnp.where(i == 0, h0, last[jnp.maximum(i - 1, 0)])
    return jnp.concatenate([incoming[None], ends[:-1]])


def shift_backward(mu: Array, axis_name: str | None) -> Array:
    """`mu[k + 1]` for every chunk `k` (zero after the last one); with `axis_name`, a
    device's last chunk reads the next device's first."""
    if axis_name is None:
        return shift_in(mu, 0, reverse=True)
    first = lax.all_gather(mu[0], axis_name)
    devices = first.shape[0]
    i = lax.axis_index(axis_name)
    incoming = jnp.where(i == devices - 1, 0, first[jnp.minimum(i + 1, devices - 1)])
    return jnp.concatenate([mu[1:], incoming[None]])
