"""Inclusive scans under any associative combine, in sequence, in parallel or in chunks.

The building blocks are shared with `linear_recurrence`, which is one such scan (of
affine maps) with a state to act on: `fold` runs a step function along time, either
the time axis itself (`lax.scan`) or the steps inside chunks laid out `(K, C, ...)`,
vectorised over the chunks; `doubling` scans a short sequence (the chunks' totals) in
`ceil(log2 n)` rounds of one compiled loop body.
"""

from collections.abc import Callable
from typing import Literal

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ._arguments import check_flag
from ._chunking import default_chunk_size, from_chunks, to_chunks
from ._eager import compiled_when_eager, compiles_once

ScanMethod = Literal["sequential", "associative", "chunked"]
SCAN_METHODS = ("sequential", "associative", "chunked")

_tree_map = jax.tree_util.tree_map


# on a TPU, sequences up to this many steps run sequentially: as fast, compiled in a
# third of the time (docs/benchmarks.md, "Short sequences on a TPU")
_TPU_SEQUENTIAL_UP_TO = 2048


def auto_method(length: int | None = None) -> str:
    """The measured best method for the backend and the number of steps
    (docs/benchmarks.md): on CPU the per-step cost of a loop is low and the parallel
    methods only add work; on accelerators the chunked method wins on long sequences.
    On a TPU v5e a loop step costs well under a microsecond, and up to 2048 steps
    (d = 32, dense or elementwise) the sequential loop was as fast as the chunked
    method and compiled in a third of the time; on GPUs (not measured) chunked.

    **Arguments:**

    - `length`: the number of steps, if known.

    **Returns:**

    `"sequential"` or `"chunked"`.
    """
    backend = jax.default_backend()
    if backend == "cpu":
        return "sequential"
    if backend == "tpu" and length is not None and length <= _TPU_SEQUENTIAL_UP_TO:
        return "sequential"
    return "chunked"


def at_step(x, s, axis: int):
    """Step `s` of `x` along `axis`; an axis of length 1 is shared by every step."""
    if x.shape[axis] == 1:
        return lax.index_in_dim(x, 0, axis, keepdims=False)
    return lax.dynamic_index_in_dim(x, s, axis, keepdims=False)


def fold(step, carry, xs, *, axis: int, reverse: bool, emit: bool = True, start=0):
    """`carry, y = step(carry, x)` for every step `x` of `xs` along `axis`.

    `axis=0` is time, run by `lax.scan`. `axis=1` runs the steps inside chunks laid out
    `(K, C, ...)`, vectorised over the K chunks by a `fori_loop` that reads and writes
    strided slices, so no transposed copy is ever made; the `y`s go to a fresh buffer
    that nothing else reads (a loop that read and overwrote one buffer lets XLA copy
    the whole buffer on every step, O(T^2): jax #10197). Leaves whose axis has length
    1 are shared by every step. `start` skips that many steps (in processing order),
    whose rows of the output are zeros. Returns `(ys, carry)`; `ys` is `None` unless
    `emit`.
    """
    n = max(x.shape[axis] for x in jax.tree_util.tree_leaves(xs))
    if axis == 0:
        if start:
            raise NotImplementedError("fold: `start` along axis 0")
        leaves, tree = jax.tree_util.tree_flatten(xs)
        shared = [n > 1 and x.shape[0] == 1 for x in leaves]
        scanned = [None if s else x for x, s in zip(leaves, shared)]

        def scan_step(c, x):
            x = [full[0] if s else x for x, s, full in zip(x, shared, leaves)]
            c, y = step(c, jax.tree_util.tree_unflatten(tree, x))
            return c, (y if emit else None)

        carry, ys = lax.scan(scan_step, carry, scanned, length=n, reverse=reverse)
        return ys, carry

    at = lambda s: _tree_map(lambda x: at_step(x, s, axis), xs)
    out = None
    if emit:  # zeros typed like the steps' outputs (inside shard_map, as varying)
        _, y = step(carry, at(n - 1 if reverse else 0))

        def zeros(y):
            y = jnp.expand_dims(jnp.zeros_like(y), axis)
            return jnp.broadcast_to(y, (*y.shape[:axis], n, *y.shape[axis + 1 :]))

        out = _tree_map(zeros, y)

    def body(i, state):
        c, out = state
        s = n - 1 - i if reverse else i
        c, y = step(c, at(s))
        if emit:
            out = _tree_map(
                lambda o, y: lax.dynamic_update_index_in_dim(o, y, s, axis), out, y
            )
        return c, out

    carry, out = lax.fori_loop(start, n, body, (carry, out))
    return out, carry


def doubling(combine, elems, *, reverse: bool, identity=None):
    """Inclusive scan by recursive doubling (Hillis-Steele): `ceil(log2 n)` rounds of
    one `fori_loop`, so the compiled program does not grow with `n` (unlike
    `lax.associative_scan`'s). Round `k` combines every element with the one `2^k`
    steps earlier. Work `O(n log n)`: meant for short sequences (chunk totals).
    `identity` (a pytree like one element, broadcastable) fills the steps before the
    first; without it those steps are left as they are."""
    n = jax.tree_util.tree_leaves(elems)[0].shape[0]
    index = jnp.arange(n)
    if reverse:
        index = n - 1 - index

    def shifted(x, pad, shift):  # `x` moved `shift` steps later (earlier if reverse)
        pad = jnp.broadcast_to(pad, x.shape)
        if reverse:
            return lax.dynamic_slice_in_dim(jnp.concatenate([x, pad]), shift, n)
        return lax.dynamic_slice_in_dim(jnp.concatenate([pad, x]), n - shift, n)

    def body(k, elems):
        shift = jnp.left_shift(1, k)
        pads = elems if identity is None else identity
        earlier = _tree_map(lambda x, p: shifted(x, p, shift), elems, pads)
        new = combine(earlier, elems)
        if identity is not None:
            return new
        keep = index < shift
        return _tree_map(
            lambda x, y: jnp.where(keep.reshape((n,) + (1,) * (x.ndim - 1)), x, y),
            elems,
            new,
        )

    rounds = max(0, (n - 1).bit_length())
    return lax.fori_loop(0, rounds, body, elems)


def _take(tree, i, axis: int = 0):
    return _tree_map(lambda x: lax.index_in_dim(x, i, axis, keepdims=False), tree)


def _sequential(combine, elems, *, reverse: bool):
    first = -1 if reverse else 0
    head = _take(elems, first)
    rest = _tree_map(lambda x: x[:-1] if reverse else x[1:], elems)

    def step(c, x):
        c = combine(c, x)
        return c, c

    ys, _ = fold(step, head, rest, axis=0, reverse=reverse)
    join = lambda h, y: jnp.concatenate([y, h[None]] if reverse else [h[None], y])
    return _tree_map(join, head, ys)


def _chunked(combine, elems, *, reverse: bool, chunk_size: int):
    """Two passes over chunks of `chunk_size` steps, vectorised across chunks: each
    chunk's total, a doubling scan over the totals, then each chunk again from the
    total of all chunks before it, emitting. Nothing T-long is kept but the input and
    the output."""
    length = jax.tree_util.tree_leaves(elems)[0].shape[0]
    # the padding repeats the last element in processing order: padded steps come
    # after every real one and never reach it
    edge = _take(elems, 0 if reverse else -1)
    chunks = to_chunks(elems, chunk_size, fill=edge, front=reverse)
    first = chunk_size - 1 if reverse else 0

    def step(c, x):
        c = combine(c, x)
        return c, c

    head = _take(chunks, first, axis=1)
    _, totals = fold(step, head, chunks, axis=1, reverse=reverse, emit=False, start=1)
    totals = doubling(combine, totals, reverse=reverse)
    # chunk k starts from the total of the chunks before it (the first from its head)
    before = _tree_map(
        lambda t, h: jnp.concatenate([t[1:], h[-1:]] if reverse else [h[:1], t[:-1]]),
        totals,
        head,
    )
    combined = combine(before, head)
    k = jax.tree_util.tree_leaves(chunks)[0].shape[0]
    alone = jnp.arange(k) == (k - 1 if reverse else 0)
    start = _tree_map(
        lambda h, c: jnp.where(alone.reshape((k,) + (1,) * (h.ndim - 1)), h, c),
        head,
        combined,
    )
    ys, _ = fold(step, start, chunks, axis=1, reverse=reverse, start=1)
    ys = _tree_map(lambda y, s: y.at[:, first].set(s), ys, start)
    return from_chunks(ys, length, front=reverse)


def _across_devices(combine, local, *, axis_name: str, reverse: bool):
    """Inside `shard_map`: each device's inclusive scan `local` of its block, made
    global by combining into it the total of every block before it (one `all_gather`
    of the block totals)."""
    total = _take(local, 0 if reverse else -1)
    totals = _tree_map(lambda x: lax.all_gather(x, axis_name), total)
    devices = jax.tree_util.tree_leaves(totals)[0].shape[0]
    prefixes = _sequential(combine, totals, reverse=reverse)
    i = lax.axis_index(axis_name)
    j = jnp.clip(i + 1 if reverse else i - 1, 0, devices - 1)
    before = _tree_map(lambda p: p[j], prefixes)
    length = jax.tree_util.tree_leaves(local)[0].shape[0]
    before = _tree_map(lambda p: jnp.broadcast_to(p, (length, *p.shape)), before)
    combined = combine(before, local)
    alone = i == (devices - 1 if reverse else 0)
    return _tree_map(lambda x, c: jnp.where(alone, x, c), local, combined)


def associative_scan(
    combine: Callable[[PyTree[Array], PyTree[Array]], PyTree[Array]],
    elems: PyTree[Array],
    *,
    reverse: bool = False,
    method: ScanMethod = "associative",
    chunk_size: int | None = None,
    axis_name: str | None = None,
) -> PyTree[Array]:
    """The inclusive scan of `elems` under an associative `combine`: element `t` of the
    result is `combine` folded over elements `0..t` (over `t..T-1` if `reverse`).
    Called eagerly with a `combine` of JAX's own (`jnp.maximum`) or an Equinox
    module, compiled once for each configuration (the same `combine`, shapes, dtypes
    and arguments), as `pscan.recurrence` is; a plain function is traced anew at
    every eager call.

    **Arguments:**

    - `combine`: `combine(earlier, later)`, associative, on pytrees like `elems` whose
        leaves carry any number of leading axes (it is called on whole slices of
        elements at once, as `jax.lax.associative_scan` calls it).
    - `elems`: a pytree of arrays sharing a leading time axis of length `T >= 1`.
    - `reverse`: scan from the end: "earlier" is the later time step.
    - `method`: `"associative"` (`jax.lax.associative_scan`, nothing added: depth
        `O(log T)`), `"sequential"` (`lax.scan`: `T - 1` combines one after another),
        or `"chunked"` (sequential inside chunks of `chunk_size` steps, vectorised
        across chunks, then a scan over the chunk totals and a second pass over the
        chunks from their true starts: depth `O(C + log(T / C))`, and nothing
        `T`-long kept besides the input and the output, where `"associative"` keeps
        about twice the input).
    - `chunk_size`: steps per chunk for `"chunked"` (default: 64 on CPU, 128 on
        accelerators).
    - `axis_name`: inside `shard_map`, the mesh axis that splits time: `elems` is this
        device's block of consecutive steps, and the result this device's block of
        the global scan (one `all_gather` of the block totals).

    **Returns:**

    A pytree like `elems`.

    **Raises:**

    `ValueError` at trace time for an unknown `method`, a `reverse` that is not a bool,
    a `chunk_size` that is not a positive integer (or given without
    `method="chunked"`), or leaves without a common leading axis.
    """
    reverse = check_flag("associative_scan", "reverse", reverse)
    if method not in SCAN_METHODS:
        raise ValueError(
            f"pscan.associative_scan: `method` must be one of {SCAN_METHODS}, got {method!r}"
        )
    if chunk_size is not None:
        if method != "chunked":
            raise ValueError(
                f"pscan.associative_scan: `chunk_size` only applies to method='chunked', "
                f"got method={method!r} with chunk_size={chunk_size}"
            )
        if (
            isinstance(chunk_size, bool)
            or not isinstance(chunk_size, int)
            or chunk_size < 1
        ):
            raise ValueError(
                f"pscan.associative_scan: `chunk_size` must be a positive int, got "
                f"{chunk_size!r}"
            )
    leaves = jax.tree_util.tree_leaves(elems)
    shapes = [jnp.shape(x) for x in leaves]
    if not leaves or any(len(s) == 0 or s[0] != shapes[0][0] for s in shapes):
        raise ValueError(
            "pscan.associative_scan: `elems` must be arrays with a common leading "
            f"(time) axis, got shapes {shapes}"
        )
    elems = _tree_map(jnp.asarray, elems)
    if shapes[0][0] == 0:
        return elems
    # in eager mode compiled once for a configuration (the same `combine`, shapes and
    # arguments), not traced and compiled anew at every call; a plain function
    # `combine` may read globals that change between calls: traced at every call
    scan = _scan if compiles_once(combine) else scan_elements
    return scan(combine, elems, reverse, method, chunk_size, axis_name)


def scan_elements(combine, elems, reverse: bool, method: str, chunk_size, axis_name):
    """`associative_scan` without its checks, for pscan's own scans (inside their
    callers' traces): `elems` arrays with a common leading axis of length >= 1,
    `method` one of `SCAN_METHODS`."""
    if method == "associative":
        local = lax.associative_scan(combine, elems, reverse=reverse)
    elif method == "sequential":
        local = _sequential(combine, elems, reverse=reverse)
    else:
        length = jax.tree_util.tree_leaves(elems)[0].shape[0]
        size = chunk_size or default_chunk_size(length)
        local = _chunked(combine, elems, reverse=reverse, chunk_size=size)
    if axis_name is None:
        return local
    return _across_devices(combine, local, axis_name=axis_name, reverse=reverse)


_scan = compiled_when_eager(scan_elements)
