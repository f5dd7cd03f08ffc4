"""Linear recurrences `h[t] = a[t] * h[t-1] + b[t]`, in sequence or in parallel.

`linear_recurrence` validates its arguments and binds a JAX primitive whose rules make it
exactly differentiable at the cost of the forward pass:

- JVP: the tangent `dh[t] = a[t] dh[t-1] + (da[t] h[t-1] + db[t])` is the same recurrence
  with new inputs, so forward mode is one more call of the primitive;
- transpose: the primitive is linear in `(b, h0)`; its transpose is the reverse-time
  recurrence with shifted (and, for dense `a`, transposed) coefficients
  `lam[t] = g[t] + a[t+1]^T lam[t+1]`, run with the same method. Reverse mode is JVP
  followed by this transpose, so the backward pass saves only `a` and `hs` and never
  differentiates through the scan's internals;
- batching: a batch axis becomes a state axis right after time.
"""

from typing import Literal

import jax
import jax.core
import jax.extend.core
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, ArrayLike, Bool, Inexact, Int

from ._arguments import check_flag
from ._associative import at_step, auto_method, doubling, fold, scan_elements
from ._axis import like_inputs
from ._blocks import block_matmul
from ._chunking import default_chunk_size, from_chunks, shift_in, to_chunks
from ._finite import finite_along
from ._segments import along_time, segment_masks

Method = Literal["auto", "sequential", "associative", "chunked"]
_METHODS = ("auto", "sequential", "associative", "chunked")


# --------------------------------------------------------------------------------------
# Coefficient algebra: `a` acts on a state either elementwise or as a matrix on the last
# axis. All helpers broadcast, so `a` may carry size-1 axes where it is shared.
# --------------------------------------------------------------------------------------


def _apply(a, h, dense: bool):
    """`a` acting on `h`."""
    if dense:
        return jnp.matmul(a, h[..., None], precision=lax.Precision.HIGHEST)[..., 0]
    return a * h


def _act(a, h, dense: bool, zero_matrices: bool = False):
    """`a` acting on a state `h` (or a partial state, or a cotangent) inside a solve,
    where a zero times anything is zero: an entry of elementwise `a`; with
    `zero_matrices`, a whole matrix (or state) when `a` is dense. A zero coefficient
    forgets the state whatever its value, so that a reset (`a = 0`) stops a
    non-finite state as running the segments separately would; a zero state is not
    made NaN by an infinite or NaN coefficient, so that a parallel combine never
    forms `inf * 0` from a composed coefficient that overflowed (|a| > 1 over many
    steps), and the backward pass of a loss that never reaches a step never sees
    that step's coefficients. The dense guard reads `a` once more (3x the time of
    the plain loop on CPU, d = 32): `_solve` runs it only to redo results that are
    not finite, and only for coefficients with resets in them. (Not used by the
    derivative rules, which must stay linear in their tangents.)"""
    if not dense:
        return jnp.where((a == 0) | (h == 0), jnp.zeros((), h.dtype), a * h)
    ah = _apply(a, h, dense)
    if not zero_matrices:
        return ah
    zero = jnp.all(a == 0, axis=(-2, -1)) | jnp.all(h == 0, axis=-1)
    return jnp.where(zero[..., None], jnp.zeros((), h.dtype), ah)


def _compose(a_later, a_earlier, dense: bool):
    """The coefficient of applying `a_earlier`, then `a_later` (a zero factor makes
    it zero, as in `_act`; dense products unguarded)."""
    if dense:
        return block_matmul(a_later, a_earlier)
    zero = (a_later == 0) | (a_earlier == 0)
    return jnp.where(zero, jnp.zeros((), a_later.dtype), a_later * a_earlier)


def _product(a, axis: int, dense: bool = False):
    """The elementwise product of `a` along `axis`: zero wherever a factor is zero
    (even with a non-finite one beside it, as `_compose`). Differentiable as the
    product: beside a zero, the non-finite factors count as 1 (the derivative with
    respect to the zero factor is the product of the others, not lost to a guard)."""
    zero = jnp.any(a == 0, axis=axis, keepdims=True)
    return jnp.prod(jnp.where(zero & ~jnp.isfinite(a), 1, a), axis=axis)


def _identity_like(a, dense: bool):
    """The identity coefficient, shaped like one time step of `a`."""
    if dense:
        return jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape[1:])
    return jnp.ones((), a.dtype)


def _full_time(a, length: int):
    """`a` with its (possibly shared, length-1) time axis materialised to `length`."""
    return jnp.broadcast_to(a, (length, *a.shape[1:]))


# --------------------------------------------------------------------------------------
# The three evaluation strategies. Each takes `a` whose time axis has length T or 1
# (shared by all steps) and whose other axes broadcast against `b`, `b` of shape
# (T, *S) and `h0` of shape S.
# --------------------------------------------------------------------------------------


def _loop(
    a,
    b,
    h0,
    *,
    axis: int,
    reverse: bool,
    dense: bool,
    emit=True,
    adjoint=False,
    zero_matrices=False,
):
    """The one sequential loop: the recurrence along `axis` of `a` and `b` (time, or
    the steps inside chunks laid out `(K, C, ...)`, vectorised over the chunks: see
    `fold`). Returns `(hs, h_final)`; `hs` is `None` unless `emit`. `zero_matrices`:
    `_act`'s guard of dense zero matrices.

    `adjoint=True` runs the transposed recurrence `lam[t] = b[t] + a[t+1] lam[t+1]`
    (indices mirrored if `reverse`) in message form: it emits `lam = b[s] + m` and
    carries `m = a[s] lam`, so `a` is read unshifted (no T-long copy) and the final
    carry is the cotangent of the initial state.
    """

    def step(h, ab):
        a_s, b_s = ab
        if adjoint:
            y = b_s + h
            return _act(a_s, y, dense, zero_matrices), y
        h = _act(a_s, h, dense, zero_matrices) + b_s
        return h, h

    # inside shard_map the carry must vary across devices as the inputs do
    h0 = like_inputs(h0, b, axis)
    return fold(step, h0, (a, b), axis=axis, reverse=reverse, emit=emit)


def _sequential(a, b, h0, *, reverse: bool, dense: bool, zero_matrices=False):
    """One step at a time: depth and work `O(T)`."""
    loop = _loop(
        a, b, h0, axis=0, reverse=reverse, dense=dense, zero_matrices=zero_matrices
    )
    return loop[0]


def _finite_or(hs, exact):
    """`hs` (an array, or a pytree of them) if every entry is finite, else `exact()`,
    the loop with every zero guard.
    A parallel method combines terms the loop never forms: with infinite inputs, or
    products of coefficients that overflow (|a| > 1 over many steps), a state can be
    NaN (inf * 0, inf - inf) or an inf of the other sign where the loop's is +-inf or
    finite; and dense products have no cheap zero guard, so a reset (a zero matrix)
    would pass a NaN or inf state on. The test is that the states' sum is finite: any
    non-finite state makes it so (it costs less than `all(isfinite(hs))`, and a sum
    that overflows only sends finite states to the loop, which is exact)."""
    leaves = jax.tree_util.tree_leaves(hs)
    finite = jnp.all(jnp.stack([jnp.isfinite(jnp.sum(x)) for x in leaves]))
    return lax.cond(finite, lambda: hs, exact)


def _associative(a, b, h0, *, reverse: bool, dense: bool, zero_h0: bool):
    """`lax.associative_scan` on `(a, b)` pairs: depth `O(log T)`, work `O(T)` combines
    (each `O(d^3)` for dense `a`). The plain affine combine, as a direct
    `lax.associative_scan` has it; `h0` enters at the end through the scanned
    coefficients (`hs[t] += A[t] h0`, no copy of `b`), and not at all when it is known
    to be zero. Non-finite states are recomputed by `_solve`'s loop, so the zero
    guards of `_act` are not needed here."""
    a = _full_time(a, b.shape[0])

    def combine(earlier, later):
        a_e, b_e = earlier
        a_l, b_l = later
        a_c = (
            jnp.matmul(a_l, a_e, precision=lax.Precision.HIGHEST)
            if dense
            else a_l * a_e
        )
        return a_c, _apply(a_l, b_e, dense) + b_l

    products, hs = scan_elements(combine, (a, b), reverse, "associative", None, None)
    return hs if zero_h0 else hs + _apply(products, h0, dense)


def _doubling(a, b, h0, *, reverse: bool, dense: bool):
    """The recurrence by recursive doubling (`doubling`): depth `O(log T)`, work
    `O(T log T)`, a compiled program that does not grow with `T`. Used for the chunk
    summaries of the chunked method, where `T/C` elements make the extra `log` factor
    cheap."""
    first = -1 if reverse else 0
    a = _full_time(a, b.shape[0])
    b = b.at[first].add(_act(a[first], h0, dense))

    def combine(earlier, later):
        a_e, b_e = earlier
        a_l, b_l = later
        return _compose(a_l, a_e, dense), _act(a_l, b_e, dense) + b_l

    identity = (_identity_like(a, dense), jnp.zeros((), b.dtype))
    return doubling(combine, (a, b), reverse=reverse, identity=identity)[1]


def _chunked(
    a, b, h0, *, reverse: bool, dense: bool, chunk_size: int, zero_matrices=False
):
    """Exact sequential loops inside chunks, vectorised across chunks.

    Two passes over the chunks: the first runs each chunk from a zero state to get its
    summary `(P_k, e_k)` (`P_k` the product of its coefficients, `e_k` its end state);
    a doubling scan over the K summaries gives every chunk's true start state; the
    second pass reruns each chunk from its start, emitting the states. Nothing T-long
    besides the inputs and the output is stored. Depth `O(T/K + log K)`.

    The states are the loop's own whenever the starts are. With infinite inputs (or
    products that overflow) `P_k s + e_k` is not the loop's arithmetic: NaN (`inf * 0`,
    `inf - inf`) or an inf of the other sign where the loop's state is +-inf, so when
    a start is not finite every start is recomputed by the loop over the chunks one
    after another (exact, sequential, and only ever run on such data).
    """
    length = b.shape[0]
    # Padding goes last in processing order (the end of time, or its start if
    # `reverse`): padded steps never reach a real one, so zeros do as filler.
    bc = to_chunks(b, chunk_size, fill=0, front=reverse)
    zeros = jnp.zeros((bc.shape[0], *bc.shape[2:]), b.dtype)
    if a.shape[0] == 1:  # shared by all steps
        ac = a[None]
    else:
        ac = to_chunks(a, chunk_size, fill=0, front=reverse)
    if dense:
        # the chunk's transition matrix: the ordered product of its C matrices
        eye = jnp.broadcast_to(_identity_like(a, dense), (ac.shape[0], *ac.shape[2:]))
        eye = like_inputs(eye, ac, axis=1)

        def step(i, p):
            s = chunk_size - 1 - i if reverse else i
            return _compose(at_step(ac, s, axis=1), p, dense)

        p = lax.fori_loop(0, chunk_size, step, eye)
    elif a.shape[0] == 1:
        p = lax.integer_pow(ac[:, 0], chunk_size)
    else:
        p = _product(ac, axis=1)
    _, e = _loop(ac, bc, zeros, axis=1, reverse=reverse, dense=dense, emit=False)
    ends = _doubling(p, e, h0, reverse=reverse, dense=dense)

    def exact(emit: bool):
        """The loop over the chunks one after another: the chunks' ends, or (`emit`)
        every state, with `_act`'s zero guards."""

        def chunk(h, ab):
            loop = _loop(
                *ab,
                h,
                axis=0,
                reverse=reverse,
                dense=dense,
                emit=emit,
                zero_matrices=zero_matrices,
            )
            return loop[1], loop[0] if emit else loop[1]

        xs = (jnp.broadcast_to(ac, (bc.shape[0], *ac.shape[1:])), bc)
        return lax.scan(chunk, h0, xs, reverse=reverse)[1]

    ends = lax.cond(finite_along(ends), lambda: ends, lambda: exact(emit=False))
    starts = shift_in(ends, h0, reverse)
    hs, _ = _loop(ac, bc, starts, axis=1, reverse=reverse, dense=dense)
    if zero_matrices:  # no cheap guard in the loops: see `_finite_or`
        hs = _finite_or(hs, lambda: exact(emit=True))
    return from_chunks(hs, length, front=reverse)


def _one_state_axis(a, b, h0, dense: bool):
    """`(a, b, h0)` with the state axes of `b` made one, or `None` where `a` would have
    to be copied to a T-long array for that. A step of the chunked loops is then one
    wide row instead of a stack of short ones, dense in memory (measured at batch 4 x
    32 channels: half the time on a TPU v5e, 0.9x on CPU; the associative method
    gains nothing and its gradient's XLA temp grew). Elementwise `a` only: covering
    the whole state, shared by every entry of it, or shared by every step (then
    broadcast: one step's size)."""
    state = b.shape[1:]
    if dense or len(state) < 2:
        return None
    size = int(np.prod(state))
    if a.shape[1:] == state:
        a = a.reshape(a.shape[0], size)
    elif all(n == 1 for n in a.shape[1:]):
        a = a.reshape(a.shape[0], 1)
    elif a.shape[0] == 1:
        a = jnp.broadcast_to(a, (1, *state)).reshape(1, size)
    else:
        return None
    return a, b.reshape(b.shape[0], size), h0.reshape(size)


def _solve(a, b, h0, *, reverse, method, chunk_size, dense, zero_h0, zero_matrices):
    """The recurrence by `method`. `zero_matrices`: whether dense zero matrices (the
    resets) must forget the state: then results that are not all finite are redone
    by the loop with that guard."""
    sequential = lambda: _sequential(
        a, b, h0, reverse=reverse, dense=dense, zero_matrices=zero_matrices
    )
    if method == "sequential":
        if not zero_matrices:  # nothing to redo: no guard the loop lacks
            return sequential()
        hs = _sequential(a, b, h0, reverse=reverse, dense=dense)
        return _finite_or(hs, sequential)
    elif method == "chunked":  # NaN starts are recomputed inside
        flat = _one_state_axis(a, b, h0, dense)
        if flat is None:
            return _chunked(
                a,
                b,
                h0,
                reverse=reverse,
                dense=dense,
                chunk_size=chunk_size,
                zero_matrices=zero_matrices,
            )
        hs = _chunked(*flat, reverse=reverse, dense=dense, chunk_size=chunk_size)
        return hs.reshape(b.shape)
    elif method != "associative":
        raise AssertionError(method)
    # the plain combine, without zero guards
    hs = _associative(a, b, h0, reverse=reverse, dense=dense, zero_h0=zero_h0)
    return _finite_or(hs, sequential)


# --------------------------------------------------------------------------------------
# The primitive and its rules.
# --------------------------------------------------------------------------------------

_linrec_p = jax.extend.core.Primitive("pscan_linear_recurrence")
_STATIC = ("reverse", "method", "chunk_size", "dense", "zero_h0", "zero_matrices")
_linrec_p.def_impl(jax.jit(_solve, static_argnames=_STATIC))
# `b`'s own abstract value (shape, dtype and, inside shard_map, how it varies across
# devices), as the states are
_linrec_p.def_abstract_eval(lambda a, b, h0, **_: b.update(weak_type=False))
mlir.register_lowering(_linrec_p, mlir.lower_fun(_solve, multiple_results=False))


def _jvp(primals, tangents, **params):
    a, b, h0 = primals
    da, db, dh0 = tangents
    hs = _linrec_p.bind(a, b, h0, **params)
    u = jnp.zeros_like(hs)
    if type(da) is not ad.Zero:
        h_prev = shift_in(hs, h0, params["reverse"])
        u = u + _apply(da, h_prev, params["dense"])
    if type(db) is not ad.Zero:
        u = u + db
    no_dh0 = type(dh0) is ad.Zero
    dh0 = jnp.zeros_like(h0) if no_dh0 else dh0
    return hs, _linrec_p.bind(a, u, dh0, **{**params, "zero_h0": no_dh0})


def _transpose(
    ct, a, b, h0, *, reverse, dense, method, chunk_size, zero_h0, zero_matrices
):
    del zero_h0  # the cotangent's recurrence starts from zero
    if ad.is_undefined_primal(a):
        raise NotImplementedError("linear_recurrence is linear in (b, h0) only")
    if type(ct) is ad.Zero:
        return None, None, None
    a_t = jnp.swapaxes(a, -1, -2) if dense else a
    lam_0 = jnp.zeros_like(ct[0])
    # lam[t] = ct[t] + a[t+1]^T lam[t+1]: a linear recurrence in the other direction,
    # with coefficients one step ahead (behind if `reverse`)
    if method == "sequential":
        loop = lambda zero_matrices: _loop(
            a_t,
            ct,
            lam_0,
            axis=0,
            reverse=not reverse,
            dense=dense,
            adjoint=True,
            zero_matrices=zero_matrices,
        )
        lam, ct_h0 = loop(False)
        if zero_matrices:
            lam, ct_h0 = _finite_or((lam, ct_h0), lambda: loop(True))
    else:
        # the value shifted in multiplies lam's zero initial state, so it is free
        shared = a.shape[0] == 1
        a_adj = a_t if shared else shift_in(a_t, jnp.zeros((), a.dtype), not reverse)
        lam = _linrec_p.bind(
            a_adj,
            ct,
            lam_0,
            reverse=not reverse,
            method=method,
            chunk_size=chunk_size,
            dense=dense,
            zero_h0=True,
            zero_matrices=zero_matrices,
        )
        ct_h0 = _apply(a_t[-1 if reverse else 0], lam[-1 if reverse else 0], dense)
    ct_b = lam if ad.is_undefined_primal(b) else None
    ct_h0 = ct_h0 if ad.is_undefined_primal(h0) else None
    return None, ct_b, ct_h0


def _batch(args, dims, **params):
    a, b, h0 = args
    da, db, dh0 = dims
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    # the batch axis becomes the first state axis, right after time
    a = jnp.expand_dims(a, 1) if da is None else jnp.moveaxis(a, da, 1)
    if db is None:
        b = jnp.broadcast_to(b[:, None], (b.shape[0], size, *b.shape[1:]))
    else:
        b = jnp.moveaxis(b, db, 1)
    if dh0 is None:
        h0 = jnp.broadcast_to(h0, (size, *h0.shape))
    else:
        h0 = jnp.moveaxis(h0, dh0, 0)
    return _linrec_p.bind(a, b, h0, **params), 1


ad.primitive_jvps[_linrec_p] = _jvp
ad.primitive_transposes[_linrec_p] = _transpose
batching.primitive_batchers[_linrec_p] = _batch


# --------------------------------------------------------------------------------------
# Across devices: inside `shard_map`, each device holds a block of consecutive steps. It
# solves its block from a zero state and summarises it as the affine map
# `start -> A start + end` it applies to its incoming state (`A`: the block's composed
# coefficient). One `all_gather` exchanges the P summaries, a P-step recurrence over them
# (run on every device; it is tiny) gives the state entering each block, and each
# device reruns its block from its true start. Differentiation goes through the same
# code: the transpose of the `all_gather` is a reduce-scatter.
# --------------------------------------------------------------------------------------


def _block_coefficient(a, length: int, dense: bool, reverse: bool):
    """The coefficient of a whole block of `length` steps, in processing order."""
    if a.shape[0] == 1:  # shared by every step
        a0 = a[0]
        return jnp.linalg.matrix_power(a0, length) if dense else a0**length
    if not dense:
        return _product(a, axis=0)
    eye = like_inputs(_identity_like(a, dense), a)
    # as in `_product`: beside a zero matrix (a reset) a non-finite one counts as
    # the identity, so that the block's coefficient is zero, not NaN
    zero = jnp.any(jnp.all(a == 0, axis=(-2, -1)), axis=0)[..., None, None]
    finite = jnp.all(jnp.isfinite(a), axis=(-2, -1))[..., None, None]
    a = jnp.where(zero & ~finite, eye, a)

    def step(carry, a_t):
        return _compose(a_t, carry, dense), None

    return lax.scan(step, eye, a, reverse=reverse)[0]


def _across_devices(
    solve, a, b, h0, *, axis_name, reverse: bool, dense: bool, zero_matrices: bool
):
    """`solve(a, b, h0)` (the local recurrence) over a time axis split across
    `axis_name`; called inside `shard_map` with this device's block."""
    length = b.shape[0]
    local = solve(a, b, jnp.zeros_like(h0), zero_h0=True)
    end = local[0] if reverse else local[-1]
    coefficients = lax.all_gather(
        _block_coefficient(a, length, dense, reverse), axis_name
    )
    ends = lax.all_gather(end, axis_name)
    # the state after each device's block, then the one entering each block: a loop
    # over the P summaries, as the primitive (differentiated by its own rules: the
    # zero guards of its loop, differentiated as they stand, would drop the
    # derivative through a zero `h0` or a zero coefficient)
    after = _linrec_p.bind(
        coefficients,
        ends,
        h0,
        reverse=reverse,
        method="sequential",
        chunk_size=None,
        dense=dense,
        zero_h0=False,
        zero_matrices=zero_matrices,
    )
    starts = shift_in(after, h0, reverse)
    return solve(a, b, starts[lax.axis_index(axis_name)])


def _masked(a, b, h0, restart, valid, dense: bool):
    """`(a, b)` with resets and padding folded in: a step that starts from `h0` is
    `a = 0, b + a h0`; a padded step is the identity `a = 1, b = 0`. (The affine
    elements stay associative, so every method and device boundary is unchanged.)"""
    if restart is None and valid is None:
        return a, b
    a = _full_time(a, b.shape[0])
    if restart is not None:
        b = b + jnp.where(along_time(restart, b), _apply(a, h0, dense), 0)
        a = jnp.where(along_time(restart, a), jnp.zeros((), a.dtype), a)
    if valid is not None:
        b = jnp.where(along_time(valid, b), b, 0)
        a = jnp.where(along_time(valid, a), a, _identity_like(a, dense))
    return a, b


# --------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------


def _as_array(name, x):
    if x is None:
        raise ValueError(f"pscan.linear_recurrence: `{name}` is None, not an array")
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"pscan.linear_recurrence: `{name}` is not an array: {e}"
        ) from None


def _broadcasts_to(shape, target) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def linear_recurrence(
    a: Inexact[ArrayLike, "..."],
    b: Inexact[ArrayLike, "T *S"],
    h0: Inexact[ArrayLike, "*S"] | None = None,
    *,
    reverse: bool = False,
    method: Method = "auto",
    chunk_size: int | None = None,
    axis_name: str | None = None,
    resets: Bool[ArrayLike, " T"] | None = None,
    length: Int[ArrayLike, ""] | None = None,
) -> Inexact[Array, "T *S"]:
    """All states of the linear recurrence `h[t] = a[t] * h[t-1] + b[t]`, `h[-1] = h0`.

    Time is axis 0. `a` acts on the state either elementwise (diagonal, per channel, or a
    scalar per step: any shape broadcastable to `b`) or, when `a.ndim == b.ndim + 1`, as a
    matrix on the last axis: `h[t] = a[t] @ h[t-1] + b[t]` with `a` of shape
    `(T, *S[:-1], d, d)` (leading axes broadcastable). Real and complex dtypes are
    supported. Differentiable in forward and reverse mode with respect to `a`, `b` and
    `h0`; the backward pass is itself one linear recurrence, run with the same method.

    **Arguments:**

    - `a`: the coefficients, elementwise (broadcastable to `b`) or dense (see above). A
        `T`-long time axis may be omitted for elementwise `a` (it is then shared by all
        steps); dense `a` always has a time axis, of length `T` or 1.
    - `b`: the inputs, shape `(T, *S)`.
    - `h0`: the state before the first step, shape `S`. Defaults to zeros.
    - `reverse`: run from the end: `h[t] = a[t] * h[t+1] + b[t]`, `h[T] = h0`.
    - `method`: `"sequential"` (`lax.scan`), `"associative"` (`lax.associative_scan`),
        `"chunked"` (sequential inside chunks of `chunk_size` steps, vectorised across
        chunks, associative scan over chunk summaries), or `"auto"`: sequential on CPU and
        chunked on accelerators, except up to 2048 steps on a TPU, where the loop is
        as fast and compiles in a third of the time (measured; see the benchmarks
        page). `"auto"` with a `chunk_size` means chunked.
    - `chunk_size`: steps per chunk for `"chunked"`; defaults to the fastest measured
        for the backend: 64 on CPU, 128 on accelerators (see the benchmarks page).
    - `axis_name`: inside `shard_map`, the mesh axis that splits time: `a` (unless
        shared) and `b` are this device's block of consecutive steps, `h0` is
        replicated, and the result is this device's block of `hs`. Blocks are solved
        locally, summarised, exchanged with one `all_gather` and rerun from their true
        starts. Works with `jax.shard_map`'s variance checks on or off. Or use
        `pscan.sharded_linear_recurrence`, which pads and maps for you.
    - `resets`: None, or a boolean array of shape `(T,)` marking where segments start
        (packed sequences): where `resets[t]`, step `t` starts from `h0` instead of
        `h[t-1]`, so every segment runs as if alone. With `reverse=True` each segment
        runs backward from its last step, which starts from `h0`, to its first step
        `t` (where `resets[t]`). Implemented as `a[t] = 0`, `b[t] += a[t] * h0`, so
        every method, chunk and device boundary works as without resets; a reset's
        zero coefficient (a zero matrix, for dense `a`) forgets even a non-finite
        state, so a NaN never crosses a reset, in the states or their derivatives.
    - `length`: None, or an integer scalar (may be traced, e.g. one per sequence of a
        right-padded batch under `jax.vmap`): steps `t >= length` leave the state
        unchanged, so `hs[T-1]` is the state after step `length - 1`; with
        `reverse=True`, `h0` is carried through the padding and the recurrence runs
        backward from step `length - 1`. A `length` of `T` or more leaves every step
        real; `0` (or less) none: every state is `h0`.

    **Returns:**

    `hs` with the shape of `b`: `hs[t]` is the state after step `t`. Its dtype is
    `b`'s, made complex when `a` is (real and complex arguments of one precision mix:
    the real ones are promoted). Every method gives the sequential loop's states on
    non-finite data too (NaN or +-inf in an argument, states that overflow): where a
    parallel method's states are not all finite, the loop recomputes them (the chunked
    method checks only its chunk starts, and every state for dense `a` with resets),
    so an inf stays an inf of the loop's sign.
    In the elementwise algebra a zero times anything is zero (a zero state after a
    reset, or a zero cotangent): a loss on the steps before a NaN or inf coefficient
    has the finite gradient of that prefix, by every method (`lax.scan` gives NaN).

    **Raises:**

    `ValueError` at trace time for arguments whose shapes or dtypes do not fit together,
    an unknown `method`, a `chunk_size` that is not a positive integer, a `reverse`
    that is not a bool, `resets` that is not a boolean `(T,)` array, or a `length`
    that is not an integer scalar.
    """
    reverse = check_flag("linear_recurrence", "reverse", reverse)
    if method not in _METHODS:
        raise ValueError(
            f"pscan.linear_recurrence: `method` must be one of {_METHODS}, got {method!r}"
        )
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(
            chunk_size, (int, np.integer)
        ):
            raise ValueError(
                f"pscan.linear_recurrence: `chunk_size` must be a positive int, got {chunk_size!r}"
            )
        if chunk_size < 1:
            raise ValueError(
                f"pscan.linear_recurrence: `chunk_size` must be >= 1, got {chunk_size}"
            )
        if method == "auto":
            method = "chunked"
        elif method != "chunked":
            raise ValueError(
                f"pscan.linear_recurrence: `chunk_size` only applies to method='chunked', "
                f"got method={method!r} with chunk_size={chunk_size}"
            )
        chunk_size = int(chunk_size)
    b = _as_array("b", b)
    a = _as_array("a", a)
    h0 = None if h0 is None else _as_array("h0", h0)
    if b.ndim == 0:
        raise ValueError(
            "pscan.linear_recurrence: `b` must have a leading time axis, got a scalar"
        )
    # one dtype for the states, by JAX's promotion rules, alike for `a`, `b` and `h0`
    # (a Python scalar or list adapts to the arrays)
    given = [x for x in (a, b, h0) if x is not None]
    dtype = jnp.result_type(*given)
    if not jnp.issubdtype(dtype, jnp.inexact):
        names = "`a`, `b`" + ("" if h0 is None else ", `h0`")
        raise ValueError(
            f"pscan.linear_recurrence: the states must be floating or complex, but "
            f"{names} have dtypes {', '.join(str(x.dtype) for x in given)}"
        )
    a, b = a.astype(dtype), b.astype(dtype)
    steps, state = b.shape[0], b.shape[1:]
    dense = a.ndim == b.ndim + 1
    if dense:
        if b.ndim < 2:
            raise ValueError(
                f"pscan.linear_recurrence: dense `a` (ndim {a.ndim}) needs `b` with a state "
                f"axis, got `b` with shape {b.shape}"
            )
        d = state[-1]
        if a.shape[-2:] != (d, d):
            raise ValueError(
                f"pscan.linear_recurrence: dense `a` must end in ({d}, {d}) to act on the "
                f"last axis of `b` (shape {b.shape}), got `a` with shape {a.shape}"
            )
        lead = a.shape[:-2]
        if lead[0] not in (1, steps) or not _broadcasts_to(lead, b.shape[:-1]):
            raise ValueError(
                f"pscan.linear_recurrence: dense `a` with shape {a.shape} does not fit `b` with "
                f"shape {b.shape}: expected (T, *S[:-1], d, d) = "
                f"{(steps, *state[:-1], d, d)}, leading axes broadcastable"
            )
    else:
        if not _broadcasts_to(a.shape, b.shape):
            hint = ""
            if a.ndim == 1 and a.shape[0] == steps and b.ndim > 1:
                hint = " (for one scalar per step, give `a` shape (T, 1, ...))"
            if a.ndim > b.ndim + 1:
                hint = f" (dense `a` has exactly b.ndim + 1 = {b.ndim + 1} axes)"
            d = state[-1] if state else None
            if a.ndim == b.ndim and a.ndim >= 2 and a.shape[-2:] == (d, d):
                hint = (
                    f" (for one matrix shared by every step, give `a` shape "
                    f"{(1, *a.shape)}: dense `a` has a time axis)"
                )
            raise ValueError(
                f"pscan.linear_recurrence: `a` with shape {a.shape} is not broadcastable to "
                f"`b` with shape {b.shape}{hint}"
            )
        a = a.reshape((1,) * (b.ndim - a.ndim) + a.shape)
    # `a` keeps a time axis of length 1 when it is shared by all steps; other axes stay
    # broadcast too: neither is ever materialised by the sequential and chunked methods
    given_h0 = h0
    if h0 is None:
        h0 = jnp.zeros(state, b.dtype)
    else:
        h0 = h0.astype(dtype)
        if h0.shape != state:
            raise ValueError(
                f"pscan.linear_recurrence: `h0` must have shape {state} (that of `b` "
                f"{b.shape} without its time axis), got {h0.shape}"
            )
    if steps == 0:
        return jnp.zeros_like(b)
    restart, valid = segment_masks(
        "linear_recurrence",
        steps,
        resets,
        length,
        reverse=bool(reverse),
        axis_name=axis_name,
    )
    a, b = _masked(a, b, h0, restart, valid, dense)
    # a reset is a zero matrix, which a dense product does not guard cheaply
    zero_matrices = dense and restart is not None
    if method == "auto":
        method = auto_method(steps)
    if method == "chunked" and chunk_size is None:
        chunk_size = default_chunk_size(steps)
    if method != "chunked":
        chunk_size = None

    def solve(a, b, h0, zero_h0=False):
        return _linrec_p.bind(
            a,
            b,
            h0,
            reverse=bool(reverse),
            method=method,
            chunk_size=chunk_size,
            dense=dense,
            zero_h0=zero_h0,
            zero_matrices=zero_matrices,
        )

    if axis_name is None:
        return solve(a, b, h0, zero_h0=given_h0 is None)
    return _across_devices(
        solve,
        a,
        b,
        h0,
        axis_name=axis_name,
        reverse=bool(reverse),
        dense=dense,
        zero_matrices=zero_matrices,
    )
