"""Splitting a time axis into chunks and back.

A sequence of length `T` becomes `K = ceil(T / C)` chunks of `C` steps. The tail (or, for
reverse-time recurrences, the head) is padded with caller-chosen fill values -- for linear
recurrences the identity element `(a, b) = (1, 0)` -- so padded steps leave the state unchanged.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree


def num_chunks(length: int, chunk_size: int) -> int:
    """Number of chunks of `chunk_size` steps that cover `length` steps."""
    return math.ceil(length / chunk_size)


def default_chunk_size(length: int) -> int:
    """The default number of steps per chunk for a sequence of `length` steps.

    Measured (docs/benchmarks.md), linear recurrence at T = 2^19: on CPU 64 steps
    per chunk was fastest (d = 32, powers of two from 8 to 4096); on a TPU v5e 128
    (batch 4 x d = 32: 8.7 ms against 17.1 ms with 64, and 8.9 / 9.4 ms with 256 /
    512; d = 32 alone: 4.6 against 6.7 ms). On accelerators small chunks give short
    sequential depth `2C + 2 log2(T/C)` and wide vectorised steps.
    """
    size = 64 if jax.default_backend() == "cpu" else 128
    return max(1, min(length, size))


def _pad_one(x: Array, pad: int, fill, front: bool) -> Array:
    if pad == 0:
        return x
    filler = jnp.broadcast_to(jnp.asarray(fill, x.dtype), (pad, *x.shape[1:]))
    return jnp.concatenate([filler, x] if front else [x, filler], axis=0)


def to_chunks(tree: PyTree[Array], chunk_size: int, fill: PyTree, front: bool = False):
    """Pads the leading (time) axis and reshapes `(T, ...)` to `(K, C, ...)`.

    **Arguments:**

    - `tree`: arrays sharing a leading time axis of length `T`.
    - `chunk_size`: `C`.
    - `fill`: a pytree like `tree` of scalars or arrays broadcastable to one time step,
        the value written into padded steps.
    - `front`: pad at the start of time instead of the end.

    **Returns:**

    The pytree with every leaf reshaped to `(K, C, ...)`.
    """
    length = jax.tree_util.tree_leaves(tree)[0].shape[0]
    k = num_chunks(length, chunk_size)
    pad = k * chunk_size - length

    def one(x, f):
        x = _pad_one(x, pad, f, front)
        return x.reshape(k, chunk_size, *x.shape[1:])

    return jax.tree_util.tree_map(one, tree, fill)


def from_chunks(tree: PyTree[Array], length: int, front: bool = False):
    """Inverse of `to_chunks`: reshapes `(K, C, ...)` to `(T, ...)`, dropping padding."""

    def one(x):
        x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
        pad = x.shape[0] - length
        return x[pad:] if front else x[:length]

    return jax.tree_util.tree_map(one, tree)


def shift_in(xs: Array, x0, reverse: bool = False) -> Array:
    """`xs` moved one step later along the leading axis (earlier if `reverse`), with
    `x0` (broadcast to one step) entering at the vacated end."""
    x0 = jnp.broadcast_to(x0, xs.shape[1:])[None]
    if reverse:
        return jnp.concatenate([xs[1:], x0], axis=0)
    return jnp.concatenate([x0, xs[:-1]], axis=0)


def chunk_length(xs_chunks: PyTree[Array]) -> int:
    """The steps per chunk of inputs in chunks, `(K, C, ...)` leaves: `C`."""
    return jax.tree_util.tree_leaves(xs_chunks)[0].shape[1]


def group_start(i, size: int, total: int):
    """Where group `i` of `size` entries starts among `total`: the last group ends at
    `total`, overlapping the one before when `size` does not divide it (the same
    static shape for every group, and no remainder to run and concatenate)."""
    return jnp.minimum(i * size, total - size)


def map_in_groups(
    f, xs: PyTree[Array], groups: int, size: int | None = None
) -> PyTree[Array]:
    """`jax.vmap(f)(xs)` over the leading axis, computed in `groups` groups of rows
    one after another (the temporaries of one group at a time), each group's rows
    written in place into the outputs; the last group overlaps the one before when
    `groups` does not divide the rows (`lax.map` with a `batch_size` would run the
    remainder as a second call and concatenate, a copy of every output). `size`, if
    given, is the rows of a group instead (at least `rows / groups`). Outputs are
    typed like `xs` inside `shard_map` (varying where `xs` varies)."""
    leaves = jax.tree_util.tree_leaves(xs)
    rows = leaves[0].shape[0]
    size = -(-rows // max(1, groups)) if size is None else min(size, rows)
    count = -(-rows // size)
    batched = jax.vmap(f)
    if count == 1:
        return batched(xs)
    take = lambda start: jax.tree_util.tree_map(
        lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, 0), xs
    )
    shapes = jax.eval_shape(batched, take(0))

    def zeros(s):  # a zero of the inputs' variance, broadcast (no NaN from values)
        like = sum(jnp.zeros_like(x.ravel()[0], s.dtype) for x in leaves if x.size)
        return jnp.zeros((rows, *s.shape[1:]), s.dtype) + like

    def group(i, out):
        start = group_start(i, size, rows)
        put = lambda o, y: jax.lax.dynamic_update_slice_in_dim(o, y, start, 0)
        return jax.tree_util.tree_map(put, out, batched(take(start)))

    return jax.lax.fori_loop(0, count, group, jax.tree_util.tree_map(zeros, shapes))
