"""Products and solves of batches of small matrices: the one matrix product of pscan's
own dense algebra (the composed coefficients of `linear_recurrence`, ELK's Kalman
filter and smoother), the solves of that Kalman algebra, and the rule that all of it
runs half precision in float32.

On a TPU a batched product of small blocks at full float32 precision (six bfloat16
passes on the matrix units) is slow to compile: 0.4-2.1 s for one product of 64 to 4096
blocks of 32 x 32 (XLA's TPU v5e compiler, ahead of time), against 0.10-0.15 s for the
same product as an elementwise multiply and a sum. So on a TPU blocks up to 32 wide are
multiplied that way, exact float32 on the vector units; XLA's TPU cost model puts it
at 15 us against the matrix units' 139 us for 782 blocks of 32 x 32 (4 against 61 us
at 16 wide). Wider blocks, and every other backend, keep `jnp.matmul` at full
precision. See docs/benchmarks.md, "TPU v5e compiler on a CPU host".
"""

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.scipy.linalg import cho_factor, cho_solve
from jaxtyping import Array

# blocks up to this wide are multiplied elementwise on a TPU
_ELEMENTWISE_UP_TO = 32


def block_matmul(a: Array, b: Array) -> Array:
    """`a @ b` for batches of small matrices, `(..., n, m) @ (..., m, p)` (the batch
    axes broadcast), at full precision.

    **Arguments:**

    - `a`, `b`: arrays of one dtype (float or complex).

    **Returns:**

    `(..., n, p)`, the dtype of `a` and `b`.
    """
    wide = max(a.shape[-2], a.shape[-1], b.shape[-1])
    if jax.default_backend() != "tpu" or wide > _ELEMENTWISE_UP_TO:
        return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)
    # half precision is multiplied and summed in float32, as the matrix units
    # accumulate it
    elementwise = lambda a, b: jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return in_float32_at_least(elementwise, a, b)


def in_float32_at_least(op, a: Array, b: Array) -> Array:
    """`op(a, b)` on small blocks, in float32 when `a` is a half-precision float
    (bfloat16, float16: LAPACK and cuSOLVER factorise neither, and the matrix units
    accumulate them in float32), cast back to `b`'s dtype.

    **Arguments:**

    - `op`: a function of two arrays, e.g. a product or a solve `m^{-1} b`.
    - `a`, `b`: its arguments.

    **Returns:**

    `op(a, b)`.
    """
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
        wide = op(a.astype(jnp.float32), b.astype(jnp.float32))
        return wide.astype(b.dtype)
    return op(a, b)


def block_solve(m: Array, b: Array) -> Array:
    """`m^{-1} b` for a batch of small blocks: LU (LAPACK, cuSOLVER) or, on a TPU,
    Gauss-Jordan elimination. A TPU's LU factorises the blocks of a batch one after
    another (TPU v5e, d = 16: about 4.3 us a block, 90 ms for the 263 combines of 79
    blocks in ELK's chunked Kalman filter at K = 10000, where an elimination
    vectorised over the batch took 5 ms; the whole filter 12 ms with it). On a single
    block LU is 4x faster: it stays on CPU and GPU. Half-precision blocks are solved
    in float32 either way.

    **Arguments:**

    - `m`: `(..., d, d)`, invertible blocks (float or complex).
    - `b`: `(..., d, r)`, the batch axes those of `m`.

    **Returns:**

    `(..., d, r)`, the dtype of `b`.
    """
    solve = _gauss_jordan if jax.default_backend() == "tpu" else jnp.linalg.solve
    return in_float32_at_least(solve, m, b)


def block_solve_spd(m: Array, b: Array) -> Array:
    """`m^{-1} b` for a batch of real symmetric positive definite blocks (their lower
    triangles read), by Cholesky: on CPU a batch of 782 blocks of 32 x 32 compiles in
    0.10 s and runs in 3.9 ms where LU takes 0.23 s and 5.2 ms (LU's pivots become a
    permutation in a loop of its own). Complex blocks (the Kalman smoother's `F P F^T
    + I` is then not Hermitian) and a TPU's (which factorises the blocks of a batch
    one after another) go to `block_solve`.

    **Arguments:**

    - `m`: `(..., d, d)`, as `block_solve`'s.
    - `b`: `(..., d, r)`.

    **Returns:**

    `(..., d, r)`, the dtype of `b`.
    """
    if jax.default_backend() == "tpu" or not jnp.issubdtype(m.dtype, jnp.floating):
        return block_solve(m, b)
    cholesky = lambda m, b: cho_solve(cho_factor(m, lower=True), b)
    return in_float32_at_least(cholesky, m, b)


def _gauss_jordan(m, b):
    """`m^{-1} b` by Gauss-Jordan elimination with partial pivoting, one column of `m`
    per step of a loop, every step elementwise on the whole batch (no matrix
    products: exact float32 on a TPU)."""
    d = m.shape[-1]
    rows = jnp.arange(d)
    put = lambda where, row, x: jnp.where(where[:, None], row[..., None, :], x)

    def column(i, aug):
        # the pivot: the largest entry of column `i` on or below the diagonal
        size = jnp.abs(lax.dynamic_index_in_dim(aug, i, -1, keepdims=False))
        p = jnp.argmax(jnp.where(rows >= i, size, -1), axis=-1)
        at_p = rows == p[..., None]
        pivot_row = jnp.sum(jnp.where(at_p[..., None], aug, 0), axis=-2)
        row_i = lax.dynamic_index_in_dim(aug, i, -2, keepdims=False)
        aug = jnp.where(at_p[..., None], row_i[..., None, :], aug)  # swap rows i, p
        pivot_row = pivot_row / lax.dynamic_index_in_dim(pivot_row, i, -1)
        at_i = rows == i
        factor = jnp.where(at_i, 0, lax.dynamic_index_in_dim(aug, i, -1, False))
        aug = aug - factor[..., None] * pivot_row[..., None, :]
        return put(at_i, pivot_row, aug)

    aug = lax.fori_loop(0, d, column, jnp.concatenate([m, b], axis=-1))
    return aug[..., d:]
