import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from .._arguments import check_positive_int
from .._chunking import from_chunks
from ._base import (
    AbstractSolver,
    as_python,
    chunk_xs,
    finite_result,
)


class Sequential(AbstractSolver):
    """The exact recurrence, one step after another, by `lax.scan`.

    Differentiated by JAX's autodiff through the scan. With `checkpoint=C`, only
    every C-th state is kept for the backward pass and each chunk of C steps is
    recomputed there, so a gradient over T steps holds the outputs plus `O(T/C + C)`
    states' worth of residuals instead of every step's.

    **Arguments:**

    - `unroll`: passed to `lax.scan`.
    - `checkpoint`: `None`, or the number of steps between stored states (about
        `sqrt(T)` minimises memory).
    """

    unroll: int = eqx.field(static=True, default=1, converter=as_python)
    checkpoint: int | None = eqx.field(static=True, default=None, converter=as_python)

    def __check_init__(self):
        check_positive_int("Sequential", "unroll", self.unroll)
        check_positive_int("Sequential", "checkpoint", self.checkpoint, allow_none=True)

    def solve(self, problem):
        if self.checkpoint is None:
            hs = problem.scan(problem.h0, problem.xs, unroll=self.unroll)[0]
        else:
            xs_chunks = chunk_xs(problem, self.checkpoint)

            @jax.checkpoint
            def chunk(h, k):
                # read chunk k in place (a scan over `xs_chunks` itself would transpose
                # a batch axis under vmap, copying all the inputs)
                xs_k = jax.tree_util.tree_map(
                    lambda x: lax.dynamic_index_in_dim(x, k, keepdims=False), xs_chunks
                )
                hs_k, h_end = problem.scan(h, xs_k, unroll=self.unroll)
                return h_end, hs_k

            k = jax.tree_util.tree_leaves(xs_chunks)[0].shape[0]
            hs = lax.scan(chunk, problem.h0, jnp.arange(k))[1]
            hs = from_chunks(hs, problem.length)
        # non-finite states are flagged (and raise with `throw=True`)
        finite, result = finite_result(hs)
        stats = {
            "num_iterations": jnp.array(0),
            "max_residual": jnp.where(finite, 0.0, jnp.inf).astype(hs.real.dtype),
            "fell_back": jnp.array(False),
            "num_at_bound": jnp.array(0),
        }
        return hs, result, stats
