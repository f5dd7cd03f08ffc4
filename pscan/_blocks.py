"""Products of batches of small matrices: the one matrix product of pscan's own dense
algebra (the composed coefficients of `linear_recurrence`, ELK's Kalman combine).

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
    dtype = jnp.result_type(a, b)
    # half precision is multiplied and summed in float32, as the matrix units
    # accumulate it
    half = jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32
    if half:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    out = jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return out.astype(dtype)
