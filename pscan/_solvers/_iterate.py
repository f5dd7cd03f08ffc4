"""The shooting iteration: one loop for every `AbstractShootingSolver`.

The parallel solvers split time into K chunks of C steps (`Chunks`). Their unknowns are
the chunk-start states `s[k]` (`s[0] = h0`), which satisfy `s[k+1] = F_k(s[k])`, where
`F_k` runs the cell exactly and sequentially over chunk k. A solver's `step` maps the
current chunk starts (and its own state) to new ones; `shooting_forward` iterates it
to convergence, and `loop` is the while loop that every iteration here shares (the
implicit gradient's too).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._axis import everywhere, shift_forward, varying
from .._chunking import to_chunks
from .._finite import all_along, finite_along, finite_everywhere
from .._linear import linear_recurrence
from .._solution import RESULTS
from ._base import Problem
from ._chunks import Chunks


def scaled_change(new, old, rtol, atol):
    """`max |new - old| / (atol + rtol |new|)`: converged when `<= 1`. No change is no
    change even where the scale is 0 (`atol = 0` and `new = 0`); a non-finite entry
    is an infinite change (never converged)."""
    diff = jnp.abs(new - old)
    scale = atol + rtol * jnp.abs(new)
    moved = ~(diff <= 0)  # NaN moved
    ratio = jnp.where(moved, diff / jnp.where(moved, scale, 1), 0)
    # inf, not NaN: XLA CPU's vectorised max reduction can drop a NaN
    ratio = jnp.where(jnp.isnan(ratio), jnp.inf, ratio)
    return jnp.max(ratio, initial=0.0)


def loop(
    body: Callable[[PyTree], tuple[PyTree, Array]],
    init: PyTree,
    max_iters: int | Array,
    dtype,
) -> tuple[PyTree, Array, Array]:
    """`carry, change = body(carry)` from `init` while `change > 1`, at most
    `max_iters` times: `(carry, iterations, change)` (`change` is inf if none ran)."""

    def cond(c):
        _, it, change = c
        return (it < max_iters) & (change > 1)

    def step(c):
        carry, it, _ = c
        carry, change = body(carry)
        return carry, it + 1, change

    inf = jnp.array(jnp.inf, dtype)
    return lax.while_loop(cond, step, (init, jnp.array(0), inf))


def _finite_rows(x):
    """Per chunk start: whether all its entries are finite, `(K,)`."""
    return finite_along(x, axis=-1)


def _first_guess(solver, chunks: Chunks) -> Array:
    """The chunk starts to iterate from: `h0` everywhere, or a warm start's states at
    the chunk boundaries (`h0` where those are not finite)."""
    problem, axis = chunks.problem, chunks.axis_name
    if problem.guess is None:
        starts = jnp.broadcast_to(problem.h0, (chunks.count, problem.h0.shape[0]))
        return varying(starts, axis)
    ends = to_chunks(problem.guess, solver.chunk_size, fill=problem.guess[-1])
    starts = chunks.shift(ends[:, -1])
    return jnp.where(jnp.isfinite(starts), starts, problem.h0)


def _iterate(solver, chunks: Chunks):
    """The solver's steps in the shared `loop`: `((starts, state, held, at_bound),
    iterations, change)`, `held[k]` whether chunk start k was non-finite in the last
    step (and kept its last value), `at_bound` in how many steps a start was held at
    the float bound."""
    axis = chunks.axis_name
    h0 = chunks.h0
    bound = jnp.sqrt(jnp.finfo(h0.dtype).max).astype(h0.dtype)

    def body(carry):
        starts, state, _, at_bound = carry
        new, state, ends = solver.step(chunks, starts, state)
        rows = _finite_rows(new)
        # a chunk start that the step made non-finite takes the value of a Picard
        # sweep from the last guess instead (which always makes progress: one more
        # chunk becomes exact), from the step's own chunk ends when it has them (no
        # second run of the chunks, in the program or at run time); the predicate is
        # the same on every device
        if ends is None:
            new = lax.cond(
                finite_everywhere(new, axis),
                lambda: new,
                lambda: jnp.where(
                    rows[:, None], new, chunks.shift(chunks.ends(starts))
                ),
            )
        else:
            new = jnp.where(rows[:, None], new, chunks.shift(ends))
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
        none_at = all_along(jnp.abs(new) != bound).astype(jnp.int32)
        bounded = everywhere(none_at, axis, lax.pmin) > 0
        change = jnp.where(bounded, change, jnp.inf)
        change = everywhere(change, axis, lax.pmax)
        # a step that changed nothing on purpose (a rejected trial step) is no sign
        # of convergence
        change = jnp.where(solver.unfinished(state), jnp.inf, change)
        return (new, state, ~rows, at_bound + ~bounded), change

    starts = _first_guess(solver, chunks)
    held = varying(jnp.zeros(chunks.count, bool), axis)
    init = (starts, solver.init(chunks, starts), held, jnp.array(0))
    return loop(body, init, solver.max_iters, h0.real.dtype)


def _loop_starts(chunks: Chunks, starts, held) -> Array:
    """The chunk starts of the sequential loop, from converged finite ones and the
    rows that were `held` (non-finite: `F_{k-1}` of a correct start, or `h0`, is).
    A non-finite start stays non-finite to the chunk's end unless the chunk forgets
    it (a reset): `bad[k] = held[k] | (bad[k-1] & carries[k-1])`, a linear recurrence
    over the chunks (across devices too); bad starts become NaN, so the chunk runs
    give non-finite states from the first non-finite step on, as the loop does."""
    axis = chunks.axis_name
    carries = ~_finite_rows(chunks.ends(jnp.full_like(starts, jnp.nan)))
    real = starts.real.dtype
    carries = shift_forward(carries.astype(real), jnp.zeros((), real), axis)
    bad = linear_recurrence(carries, held.astype(real), axis_name=axis) > 0
    return jnp.where(bad[:, None], jnp.nan, starts)


def shooting_forward(solver, problem: Problem) -> tuple[Array, RESULTS, dict[str, Any]]:
    """Iterates `solver.step` on the chunk starts: `(starts, result, stats)`, never
    differentiated (the problem's arrays are seen through `stop_gradient`).

    Converged means every finite chunk start has converged; the non-finite ones (a
    non-finite input or a cell that blows up) are then those of the sequential loop
    (`_loop_starts`), and the result is `nonfinite`. With `fallback="sequential"` the
    result is left to the caller (it depends on the states of the fallback) and
    `stats["fell_back"]` says whether to take it.
    """
    frozen = jax.tree_util.tree_map(
        lambda x: lax.stop_gradient(x) if eqx.is_array(x) else x, problem
    )
    chunks = Chunks(frozen, solver.chunk_size, solver.axis_name)
    (starts, state, held, at_bound), iters, change = _iterate(solver, chunks)
    axis = solver.axis_name
    finite = everywhere(jnp.any(held).astype(jnp.int32), axis, lax.pmax) == 0
    converged = change <= 1
    starts = lax.cond(
        finite, lambda: starts, lambda: _loop_starts(chunks, starts, held)
    )
    result = RESULTS.where(
        converged,
        RESULTS.where(finite, RESULTS.successful, RESULTS.nonfinite),
        RESULTS.max_iters_reached,
    )
    # never reads as converged (<= 1) when the states are not all finite
    change = jnp.where(finite, change, jnp.inf)
    fell_back = ~converged if solver.fallback == "sequential" else jnp.array(False)
    stats = {
        "num_iterations": iters,
        "max_residual": change,
        "fell_back": fell_back,
        "num_at_bound": at_bound,
    }
    stats.update(solver.statistics(state))
    return starts, result, stats
