"""The shooting iteration: chunked runs of the cell and the parallel-in-time loop.

The parallel solvers split time into K chunks of C steps. Their unknowns are the
chunk-start states `s[k]` (`s[0] = h0`), which satisfy `s[k+1] = F_k(s[k])`, where `F_k`
runs the cell exactly and sequentially over chunk k. A solver's `_update` maps the
current chunk starts to new ones; `shooting_forward` iterates it to convergence.
"""

from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._axis import everywhere, shift_forward, varying
from .._chunking import from_chunks
from .._solution import RESULTS
from ._base import Problem, chunk_xs


def chunk_end(problem: Problem, s: Array, xs_k: PyTree[Array]) -> Array:
    """`F_k(s)`: the state after running one chunk from `s`."""
    return problem.scan(s, xs_k, emit=False)[1]


def run_chunks(problem: Problem, starts: Array, xs_chunks: PyTree[Array]) -> Array:
    """All chunks from their starts, in parallel: states `(T, d)`."""
    hs, _ = jax.vmap(problem.scan, in_axes=(0, 0))(starts, xs_chunks)
    return from_chunks(hs, problem.length)


def _scaled_change(new, old, rtol, atol):
    """`max |new - old| / (atol + rtol |new|)`: converged when `<= 1`."""
    scale = atol + rtol * jnp.abs(new)
    return jnp.max(jnp.abs(new - old) / scale, initial=0.0)


def _iterate(solver, problem: Problem, xs_chunks):
    """The solver's sweeps in a `while_loop`: `(starts, iterations, change, finite)`."""
    k = jax.tree_util.tree_leaves(xs_chunks)[0].shape[0]
    axis = solver.axis_name
    starts = varying(jnp.broadcast_to(problem.h0, (k, problem.h0.shape[0])), axis)
    end = lambda s, xs_k: chunk_end(problem, s, xs_k)

    def all_finite(x):
        finite = jnp.all(jnp.isfinite(x)).astype(jnp.int32)
        return everywhere(finite, axis, lax.pmin) > 0

    def cond(carry):
        _, it, change, finite = carry
        return (it < solver.max_iters) & (change > 1) & finite

    def body(carry):
        starts, it, _, _ = carry
        new = solver._update(end, starts, xs_chunks, problem.h0)
        finite = all_finite(new)
        # a non-finite linearised step falls back to a Picard sweep from the last
        # finite guess, which always makes progress (one more chunk becomes exact);
        # `finite` is the same on every device, so they all take the same branch
        new = lax.cond(
            finite,
            lambda: new,
            lambda: shift_forward(jax.vmap(end)(starts, xs_chunks), problem.h0, axis),
        )
        finite = all_finite(new)
        new = jnp.where(finite, new, starts)
        change = _scaled_change(new, starts, solver.rtol, solver.atol)
        change = everywhere(change, axis, lax.pmax)
        return new, it + 1, change, finite

    inf = jnp.array(jnp.inf, problem.h0.real.dtype)
    init = (starts, jnp.array(0), inf, jnp.array(True))
    return lax.while_loop(cond, body, init)


def shooting_forward(solver, problem: Problem) -> tuple[Array, RESULTS, dict[str, Any]]:
    """Iterates `solver._update` on the chunk starts: `(starts, result, stats)`."""
    xs_chunks = chunk_xs(problem, solver.chunk_size)
    starts, iters, change, finite = _iterate(solver, problem, xs_chunks)
    converged = finite & (change <= 1)
    fell_back = jnp.array(False)
    if solver.fallback == "sequential":
        fell_back = ~converged

        def exact_starts():
            # the chunk starts of the exact sequential solution
            hs = problem.scan(problem.h0, problem.xs)[0]
            ends = hs[solver.chunk_size - 1 :: solver.chunk_size]
            return jnp.concatenate([problem.h0[None], ends[: starts.shape[0] - 1]])

        starts = lax.cond(fell_back, exact_starts, lambda: starts)
        result = RESULTS.successful
    else:
        result = RESULTS.where(
            converged,
            RESULTS.successful,
            RESULTS.where(finite, RESULTS.max_iters_reached, RESULTS.nonfinite),
        )
    stats = {"num_iterations": iters, "max_residual": change, "fell_back": fell_back}
    return starts, result, stats
