"""Products of batches of small matrices: the one matrix product of pscan's own dense
algebra (the composed coefficients of `linear_recurrence`, ELK's Kalman combine), and
the rule that this algebra runs half precision in float32 (ELK's solves too).

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
