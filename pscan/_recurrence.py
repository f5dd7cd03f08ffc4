"""`pscan.recurrence`: any cell `h[t] = cell(x[t], h[t-1])`, with a choice of solver."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from ._cell import cell_parts
from ._solution import RESULTS, Solution
from ._solvers import AbstractSolver, Sequential
from ._solvers.base import Problem


def _shape_tree(tree):
    return jax.tree_util.tree_map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def _describe(solver) -> str:
    """`Newton(chunk_size=1, ...)` on one line, whatever the Equinox version's repr."""
    fields = ", ".join(
        f"{f.name}={getattr(solver, f.name)!r}" for f in dataclasses.fields(solver)
    )
    return f"{type(solver).__name__}({fields})"


def _error_if_not_converged(hs, result, stats, solver):
    """Raises at run time when the solver stopped at `max_iters`, naming the solver,
    the iteration count and the order of magnitude of the last scaled change (error
    messages are static, so the residual is reported by decade)."""
    decades = 12
    msgs = []
    for k in range(decades + 1):
        size = f"1e{k} to 1e{k + 1}" if k < decades else f"more than 1e{decades}"
        msgs.append(
            f"pscan.recurrence: {_describe(solver)} did not converge in "
            f"{getattr(solver, 'max_iters', '?')} iterations: its last iteration still "
            f"moved a chunk-start state by {size} times the tolerance "
            "`atol + rtol * |s|`. Raise `max_iters`, loosen `rtol`/`atol`, add "
            "`damping`, use `fallback='sequential'`, or pass `throw=False` and read "
            "`sol.stats['max_residual']` (<= 1 means converged)."
        )
    change = jnp.nan_to_num(stats["max_residual"], nan=jnp.inf, posinf=1e30)
    index = jnp.clip(jnp.floor(jnp.log10(jnp.maximum(change, 1))), 0, decades)
    return eqx.branched_error_if(
        hs, result == RESULTS.max_iters_reached, index.astype(jnp.int32), msgs
    )


def recurrence(
    cell,
    xs: PyTree[Array],
    h0: PyTree[Array],
    *,
    solver: AbstractSolver = Sequential(),
    throw: bool = True,
) -> Solution:
    """All states of the recurrence `h[t] = cell(x[t], h[t-1])`, `h[-1] = h0`.

    The cell follows the Equinox convention `cell(x_t, h) -> h_next`, so
    `eqx.nn.GRUCell` and `eqx.nn.LSTMCell` (state `(h, c)`) work as they are. The cell
    is a pytree (for instance an `eqx.Module`) whose arrays are parameters: they are
    differentiated, never closed over. Inputs and states may be any pytrees. For a
    `pscan.nn.AbstractCell`, `cell.project` is applied to blocks of steps at once and
    only `cell.step` runs step by step.

    Gradients with respect to the cell's parameters, `xs` and `h0` are exact for every
    solver. `Sequential` is differentiated by autodiff through its scan; `Picard` and
    `Newton` implicitly, at their solution: the backward pass solves the transposed
    recurrence over chunk boundaries with `pscan.linear_recurrence` and takes
    vectorised per-chunk VJPs, never backpropagating through iterations.

    **Arguments:**

    - `cell`: a callable pytree, `cell(x_t, h) -> h_next` with `h_next` like `h`.
    - `xs`: a pytree of arrays with a common leading time axis of length `T >= 1`.
    - `h0`: the initial state, a pytree of floating arrays.
    - `solver`: `pscan.Sequential()` (default, exact), `pscan.Picard(...)` or
        `pscan.Newton(...)`.
    - `throw`: if the solver fails (did not converge, or non-finite states), raise an
        error at run time (through `eqx.error_if`). With `throw=False` inspect
        `sol.result` instead.

    **Returns:**

    A `pscan.Solution`: `sol.hs` is a pytree like `h0` with a leading axis of length
    `T`, `hs[t]` the state after step `t`; `sol.result` and `sol.stats` say how the
    solver fared.

    **Raises:**

    `ValueError` at trace time when `solver` is not a solver, `xs` has no common
    leading axis, `h0` is not floating, or `cell` returns a state unlike `h0`.
    """
    if not isinstance(solver, AbstractSolver):
        raise ValueError(
            f"recurrence: `solver` must be a pscan solver (Sequential, Picard, Newton), "
            f"got {solver!r}"
        )
    leaves = jax.tree_util.tree_leaves(xs)
    if not leaves or any(jnp.ndim(x) == 0 for x in leaves):
        raise ValueError(
            f"recurrence: `xs` must be arrays with a leading time axis, got "
            f"{_shape_tree(xs)}"
        )
    lengths = {jnp.shape(x)[0] for x in leaves}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            f"recurrence: the leaves of `xs` must share one nonzero leading (time) "
            f"axis, got shapes {[jnp.shape(x) for x in leaves]}"
        )
    xs = jax.tree_util.tree_map(jnp.asarray, xs)
    h0 = jax.tree_util.tree_map(jnp.asarray, h0)
    h_leaves = jax.tree_util.tree_leaves(h0)
    if not h_leaves or not all(jnp.issubdtype(x.dtype, jnp.inexact) for x in h_leaves):
        raise ValueError(
            f"recurrence: `h0` must be a pytree of floating or complex arrays, got "
            f"{_shape_tree(h0)}"
        )
    x0 = jax.tree_util.tree_map(lambda x: x[0], xs)
    try:
        out = eqx.filter_eval_shape(lambda c, x, h: c(x, h), cell, x0, h0)
    except Exception as e:  # a cell that cannot take these shapes
        raise ValueError(
            f"recurrence: `cell(x_t, h)` failed for x_t {_shape_tree(x0)} and h "
            f"{_shape_tree(h0)}: {e}"
        ) from e
    if jax.tree_util.tree_structure(out) != jax.tree_util.tree_structure(h0) or any(
        (o.shape, o.dtype) != (h.shape, h.dtype)
        for o, h in zip(jax.tree_util.tree_leaves(out), h_leaves)
    ):
        raise ValueError(
            f"recurrence: `cell(x_t, h)` must return a state like `h0` "
            f"{_shape_tree(h0)}, got {_shape_tree(out)}"
        )

    h0_flat, unravel = ravel_pytree(h0)
    cell_step, project = cell_parts(cell)

    def step(cell, z, h_flat):
        return ravel_pytree(cell_step(cell, z, unravel(h_flat)))[0]

    hs_flat, result, stats = solver.solve(Problem(step, cell, xs, h0_flat, project))
    hs = jax.vmap(unravel)(hs_flat)
    if throw:
        hs = raise_on_failure(hs, result, stats, solver)
    return Solution(hs=hs, result=result, stats=stats)


def raise_on_failure(hs, result, stats, solver):
    """`hs`, raising at run time if `result` says the solve failed."""
    hs = _error_if_not_converged(hs, result, stats, solver)
    return eqx.error_if(
        hs,
        result == RESULTS.nonfinite,
        f"pscan.recurrence: {_describe(solver)} met non-finite states: the recurrence "
        "diverges from this initial state, or its inputs or parameters are "
        "non-finite.",
    )
