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
from .._chunking import from_chunks, to_chunks
from .._linear import linear_recurrence
from .._solution import RESULTS
from ._base import Problem, chunk_xs


def chunk_end(problem: Problem, s: Array, xs_k: PyTree[Array]) -> Array:
    """`F_k(s)`: the state after running one chunk from `s`."""
    return problem.scan(s, xs_k, emit=False)[1]


def run_chunks(problem: Problem, starts: Array, xs_chunks: PyTree[Array]) -> Array:
    """All chunks from their starts, in parallel: states `(T, d)`."""
    hs, _ = jax.vmap(problem.scan, in_axes=(0, 0))(starts, xs_chunks)
    return from_chunks(hs, problem.length)


def scaled_change(new, old, rtol, atol):
    """`max |new - old| / (atol + rtol |new|)`: converged when `<= 1`. No change is no
    change even where the scale is 0 (`atol = 0` and `new = 0`)."""
    diff = jnp.abs(new - old)
    scale = atol + rtol * jnp.abs(new)
    moved = diff > 0
    ratio = jnp.where(moved, diff / jnp.where(moved, scale, 1), 0)
    return jnp.max(ratio, initial=0.0)


def _finite_rows(x):
    """Per chunk start: whether all its entries are finite, `(K,)`."""
    return jnp.all(jnp.isfinite(x), axis=-1)


def _iterate(solver, problem: Problem, xs_chunks):
    """The solver's sweeps in a `while_loop`: `(starts, iterations, change, held)`,
    `held[k]` whether chunk start k was non-finite in the last sweep (and kept its
    last value)."""
    k = jax.tree_util.tree_leaves(xs_chunks)[0].shape[0]
    axis = solver.axis_name
    if problem.guess is None:
        starts = jnp.broadcast_to(problem.h0, (k, problem.h0.shape[0]))
        starts = varying(starts, axis)
    else:  # a warm start: the guess's states at the chunk boundaries
        ends = to_chunks(problem.guess, solver.chunk_size, fill=problem.guess[-1])
        starts = shift_forward(ends[:, -1], problem.h0, axis)
        starts = jnp.where(jnp.isfinite(starts), starts, problem.h0)
    end = lambda s, xs_k: chunk_end(problem, s, xs_k)
    bound = jnp.sqrt(jnp.finfo(problem.h0.dtype).max).astype(problem.h0.dtype)

    def everywhere_all(x):
        return everywhere(jnp.all(x).astype(jnp.int32), axis, lax.pmin) > 0

    def cond(carry):
        _, it, change, _ = carry
        return (it < solver.max_iters) & (change > 1)

    def body(carry):
        starts, it, _, _ = carry
        new = solver._update(end, starts, xs_chunks, problem.h0)
        rows = _finite_rows(new)
        # a chunk start that the linearised step made non-finite takes the value of a
        # Picard sweep from the last guess instead (which always makes progress: one
        # more chunk becomes exact); the predicate is the same on every device
        new = lax.cond(
            everywhere_all(rows),
            lambda: new,
            lambda: jnp.where(
                rows[:, None],
                new,
                shift_forward(jax.vmap(end)(starts, xs_chunks), problem.h0, axis),
            ),
        )
        # what is still non-finite follows a non-finite state of the sequential
        # recurrence itself (a non-finite input, or a cell that blows up): it keeps its
        # last value, so the chunks before it still converge to their exact states
        rows = _finite_rows(new)
        new = jnp.where(rows[:, None], new, starts)
        # a linearised step can run away (chaotic cells: to 1e38 and beyond in
        # float32); held at +-sqrt(largest float), the next products stay finite and
        # the iteration keeps its progress (DEER clips at +-1e8). A start held at the
        # bound is never converged
        new = jnp.where(jnp.isfinite(new), jnp.clip(new, -bound, bound), new)
        change = scaled_change(new, starts, solver.rtol, solver.atol)
        change = jnp.where(jnp.any(jnp.abs(new) == bound), jnp.inf, change)
        change = everywhere(change, axis, lax.pmax)
        return new, it + 1, change, ~rows

    inf = jnp.array(jnp.inf, problem.h0.real.dtype)
    init = (starts, jnp.array(0), inf, varying(jnp.zeros(k, bool), axis))
    return lax.while_loop(cond, body, init)


def _loop_starts(problem: Problem, starts, held, xs_chunks, axis) -> Array:
    """The chunk starts of the sequential loop, from converged finite ones and the
    rows that were `held` (non-finite: `F_{k-1}` of a correct start, or `h0`, is).
    A non-finite start stays non-finite to the chunk's end unless the chunk forgets
    it (a reset): `bad[k] = held[k] | (bad[k-1] & carries[k-1])`, a linear recurrence
    over the chunks (across devices too); bad starts become NaN, so the chunk runs
    give non-finite states from the first non-finite step on, as the loop does."""
    end = jax.vmap(lambda s, xs_k: chunk_end(problem, s, xs_k))
    carries = ~_finite_rows(end(jnp.full_like(starts, jnp.nan), xs_chunks))
    real = starts.real.dtype
    carries = shift_forward(carries.astype(real), jnp.zeros((), real), axis)
    bad = linear_recurrence(carries, held.astype(real), axis_name=axis) > 0
    return jnp.where(bad[:, None], jnp.nan, starts)


def shooting_forward(solver, problem: Problem) -> tuple[Array, RESULTS, dict[str, Any]]:
    """Iterates `solver._update` on the chunk starts: `(starts, result, stats)`.

    Converged means every finite chunk start has converged; the non-finite ones (a
    non-finite input or a cell that blows up) are then those of the sequential loop
    (`_loop_starts`), and the result is `nonfinite`. With `fallback="sequential"` the
    result is left to the caller (it depends on the states of the fallback) and
    `stats["fell_back"]` says whether to take it.
    """
    xs_chunks = chunk_xs(problem, solver.chunk_size)
    starts, iters, change, held = _iterate(solver, problem, xs_chunks)
    axis = solver.axis_name
    finite = everywhere(jnp.any(held).astype(jnp.int32), axis, lax.pmax) == 0
    converged = change <= 1
    starts = lax.cond(
        finite,
        lambda: starts,
        lambda: _loop_starts(problem, starts, held, xs_chunks, axis),
    )
    result = RESULTS.where(
        converged,
        RESULTS.where(finite, RESULTS.successful, RESULTS.nonfinite),
        RESULTS.max_iters_reached,
    )
    # never reads as converged (<= 1) when the states are not all finite
    change = jnp.where(finite, change, jnp.inf)
    fell_back = ~converged if solver.fallback == "sequential" else jnp.array(False)
    stats = {"num_iterations": iters, "max_residual": change, "fell_back": fell_back}
    return starts, result, stats
