"""`pscan.recurrence`: any cell `h[t] = cell(x[t], h[t-1])`, with a choice of solver."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, ArrayLike, Bool, Int, PyTree

from ._arguments import check_flag
from ._cell import cell_parts
from ._eager import compiled_when_eager, compiles_once
from ._precision import TwoPrecisionCell
from ._segments import segment_masks
from ._solution import RESULTS, Solution
from ._solvers import AbstractSolver, Problem, Sequential, check_solver


def _shape_tree(tree):
    return jax.tree_util.tree_map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def recurrence(
    cell,
    xs: PyTree[Array],
    h0: PyTree[Array],
    *,
    solver: AbstractSolver = Sequential(),
    throw: bool = True,
    guess: PyTree[Array] | None = None,
    reverse: bool = False,
    resets: Bool[ArrayLike, " T"] | None = None,
    length: Int[ArrayLike, ""] | None = None,
) -> Solution:
    """All states of the recurrence `h[t] = cell(x[t], h[t-1])`, `h[-1] = h0`.

    The cell follows the Equinox convention `cell(x_t, h) -> h_next`, so
    `eqx.nn.GRUCell` and `eqx.nn.LSTMCell` (state `(h, c)`) work as they are. The cell
    is a pytree (for instance an `eqx.Module`) whose arrays are parameters: they are
    differentiated, never closed over. Inputs and states may be any pytrees. For a
    `pscan.nn.AbstractCell`, `cell.project` is applied to blocks of steps at once and
    only `cell.step` runs step by step.

    Gradients with respect to the cell's parameters, `xs` and `h0` are exact for every
    solver. `Sequential` is differentiated by autodiff through its scan; `Picard`,
    `Newton` and `ELK` implicitly, at their solution, never backpropagating through
    iterations: the backward pass pulls every chunk run back step by step from the
    states (each step recomputed, no per-step residuals kept) and solves the transposed
    recurrence over chunk boundaries as the forward solved its own (dense Jacobians at
    once with `pscan.linear_recurrence`; diagonal ones as a preconditioner; Picard by
    vector-Jacobian products alone; such an iteration goes on until it converges,
    exact after K iterations, or with `fallback="sequential"` sweeps the chunks
    sequentially after `max_iters`). Forward mode (`jax.jvp`, `jax.jacfwd`) is implicit
    the same way, the same recurrence solved in forward time. Second derivatives
    through `Picard`, `Newton` and `ELK` raise `NotImplementedError`.

    Called eagerly (outside `jax.jit`, `jax.grad`, `jax.vmap`, ...) with a module
    cell, the solve is compiled once for each configuration, as `eqx.filter_jit`
    compiles: the shapes and dtypes of the arrays, the cell's structure and non-array
    fields, the solver and the other arguments; a later call with new values runs that
    program at once. (What the cell reads from outside its fields, a global array, is
    read when it is compiled, as under `jax.jit`.) A plain-function cell is traced
    anew at every eager call. Under a transformation the solve is traced into the
    caller's program.

    **Arguments:**

    - `cell`: a callable pytree, `cell(x_t, h) -> h_next` with `h_next` like `h`: an
        `eqx.Module` (its arrays are the parameters), or a plain function, whose
        closed-over arrays are then parameters too (`eqx.filter_closure_convert`).
    - `xs`: a pytree of arrays with a common leading time axis of length `T >= 1`.
    - `h0`: the initial state, a pytree of floating arrays.
    - `solver`: `pscan.Sequential()` (default, exact), `pscan.Picard(...)`,
        `pscan.Newton(...)` or `pscan.ELK(...)`. The whole solve (the cell, its
        derivatives) is traced under the solver's matrix precision
        (`solver.matrix_precision()`: `"highest"` for Picard, Newton and ELK, whose
        chunk runs and Jacobians need it on a TPU; the caller's for `Sequential`).
    - `guess`: a warm start for the iterative solvers, a pytree like `hs` (leading
        axis `T`): for instance the states of the last training step, so that the
        next solve starts close to its answer. Only its states at chunk boundaries
        are read; it is not differentiated, and the answer does not depend on it
        (only the number of iterations does). `Sequential` ignores it.
    - `throw`: if the solver did not converge, raise an error at run time (through
        `eqx.error_if`). With `throw=False` inspect `sol.result` instead. Non-finite
        states are not a failure: they are the answer of the sequential loop (from a
        NaN or inf input or parameter, or a cell that blows up), flagged
        `RESULTS.nonfinite`, exact before the first non-finite step and non-finite
        from it on (until a reset).
    - `reverse`: run from the end, `h[t] = cell(x[t], h[t+1])`, `h[T] = h0` (`hs`
        stays in time order). Not with a solver's `axis_name`.
    - `resets`: None, or a boolean array of shape `(T,)` marking where segments start
        (packed sequences): where `resets[t]`, step `t` starts from `h0` instead of
        `h[t-1]`, so `hs` equals running every segment separately (states and
        derivatives, including those wrt `h0`, which every segment starts from). With
        `reverse=True` each segment runs backward from its last step (which starts
        from `h0`) to its first. In the parallel solvers the Jacobian across a reset
        is zero, so the segments decouple.
    - `length`: None, or an integer scalar (may be traced: one per sequence under
        `jax.vmap`): steps `t >= length` leave the state unchanged (the cell is not
        applied), so `hs[T-1]` is the state after step `length - 1`; with
        `reverse=True`, `h0` is carried through them and the recurrence runs backward
        from step `length - 1`. A `length` of `T` or more leaves every step real; `0`
        (or less) none: every state is `h0`.

    **Returns:**

    A `pscan.Solution`: `sol.hs` is a pytree like `h0` with a leading axis of length
    `T`, `hs[t]` the state after step `t`; `sol.result` and `sol.stats` say how the
    solver fared.

    **Raises:**

    `ValueError` at trace time when `solver` is not a solver, `throw` or `reverse` is
    not a bool, `xs` has no common leading axis, `h0` is not floating, or `cell`
    returns a state unlike `h0`.
    """
    check_solver("recurrence", solver)
    throw = check_flag("recurrence", "throw", throw)
    reverse = check_flag("recurrence", "reverse", reverse)
    args = (cell, xs, h0, solver, throw, guess, reverse, resets, length)
    precision = solver.matrix_precision()
    if precision is None:
        return _recurrence(*args)
    # the cell (closure conversion included), the solve and its derivative rules are
    # all traced here: under the solver's precision
    with jax.default_matmul_precision(precision):
        return _recurrence(*args)


def _recurrence(cell, xs, h0, solver, throw, guess, reverse, resets, length):
    """The solve (`_solve`: in eager mode compiled once for a configuration). A
    plain-function cell is closure-converted first, here: its closed-over arrays
    (tracers, under a transformation) enter the solve as the leaves of a module, as
    a module's parameters do."""
    # a plain function cell is traced at every eager call, as before: it may read
    # globals that change between calls (`compiles_once`)
    solve = _solve if compiles_once(cell) else _solve.__wrapped__
    if not isinstance(cell, eqx.Module):
        _, _, h0, x0 = _checked(cell, xs, h0)
        # a function that closes over arrays (`lambda x, h: jnp.tanh(W @ h + x)`): its
        # closed-over arrays become leaves of the cell, parameters as a module's are,
        # so that the solvers' implicit derivatives see them (closed over, they would
        # leak out of the custom rules as tracers)
        converted = eqx.filter_closure_convert(cell, x0, h0)
        jacobian_precision = solver.jacobian_matrix_precision()
        if jacobian_precision is not None:  # its products take the precision of the
            # trace: one conversion for the solver's Jacobians, one for the rest
            with jax.default_matmul_precision(jacobian_precision):
                jacobian = eqx.filter_closure_convert(cell, x0, h0)
            converted = TwoPrecisionCell(converted, jacobian)
        cell = converted
    return solve(cell, xs, h0, solver, throw, guess, reverse, resets, length)


def _checked(cell, xs, h0):
    """`(steps, xs, h0, x0)`: the inputs as arrays, checked against each other and the
    cell (`x0` the first step's inputs), or a `ValueError` that says what does not
    fit."""
    leaves = jax.tree_util.tree_leaves(xs)
    if not leaves or any(jnp.ndim(x) == 0 for x in leaves):
        raise ValueError(
            f"pscan.recurrence: `xs` must be arrays with a leading time axis, got "
            f"{_shape_tree(xs)}"
        )
    lengths = {jnp.shape(x)[0] for x in leaves}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            f"pscan.recurrence: the leaves of `xs` must share one nonzero leading (time) "
            f"axis, got shapes {[jnp.shape(x) for x in leaves]}"
        )
    steps = lengths.pop()
    xs = jax.tree_util.tree_map(jnp.asarray, xs)
    h0 = jax.tree_util.tree_map(jnp.asarray, h0)
    h_leaves = jax.tree_util.tree_leaves(h0)
    if not h_leaves or not all(jnp.issubdtype(x.dtype, jnp.inexact) for x in h_leaves):
        raise ValueError(
            f"pscan.recurrence: `h0` must be a pytree of floating or complex arrays, got "
            f"{_shape_tree(h0)}"
        )
    x0 = jax.tree_util.tree_map(lambda x: x[0], xs)
    try:
        out = eqx.filter_eval_shape(lambda c, x, h: c(x, h), cell, x0, h0)
    except Exception as e:  # a cell that cannot take these shapes
        raise ValueError(
            f"pscan.recurrence: `cell(x_t, h)` failed for x_t {_shape_tree(x0)} and h "
            f"{_shape_tree(h0)}: {e}"
        ) from e
    if jax.tree_util.tree_structure(out) != jax.tree_util.tree_structure(h0) or any(
        (o.shape, o.dtype) != (h.shape, h.dtype)
        for o, h in zip(jax.tree_util.tree_leaves(out), h_leaves)
    ):
        raise ValueError(
            f"pscan.recurrence: `cell(x_t, h)` must return a state like `h0` "
            f"{_shape_tree(h0)}, got {_shape_tree(out)}"
        )
    return steps, xs, h0, x0


@compiled_when_eager
def _solve(cell, xs, h0, solver, throw, guess, reverse, resets, length):
    """The solve of a module cell: inside a trace, part of the caller's program; in
    eager mode, compiled once for each configuration (arrays' shapes and dtypes, the
    cell's structure, the solver, the Python arguments: `compiled_when_eager`)."""
    steps, xs, h0, _ = _checked(cell, xs, h0)
    h_leaves = jax.tree_util.tree_leaves(h0)
    axis_name = getattr(solver, "axis_name", None)
    if reverse and axis_name is not None:
        raise ValueError(
            "pscan.recurrence: `reverse=True` cannot be combined with a solver's "
            f"`axis_name` ({axis_name!r}): flip the sequence across devices yourself"
        )
    h0_flat, unravel_flat = ravel_pytree(h0)
    # complex states are solved as real vectors (real parts, then imaginary parts): the
    # solvers' Jacobians are then real `2d x 2d` matrices, right for any cell,
    # holomorphic or not
    if jnp.iscomplexobj(h0_flat):
        d = h0_flat.shape[0]
        to_flat = lambda h: jnp.concatenate([h.real, h.imag])
        unravel = lambda r: unravel_flat(lax.complex(r[:d], r[d:]))
    else:
        to_flat, unravel = (lambda h: h), unravel_flat
    h0_flat = to_flat(h0_flat)
    cell_step, project = cell_parts(cell)

    def step(cell, z, h_flat):
        return to_flat(ravel_pytree(cell_step(cell, z, unravel(h_flat)))[0])

    guess_flat = None
    if guess is not None:
        g_leaves = jax.tree_util.tree_leaves(guess)
        if jax.tree_util.tree_structure(guess) != jax.tree_util.tree_structure(
            h0
        ) or any(jnp.shape(g) != (steps, *h.shape) for g, h in zip(g_leaves, h_leaves)):
            raise ValueError(
                f"pscan.recurrence: `guess` must be like the states `hs`: `h0`'s "
                f"structure with a leading time axis of length {steps}, got "
                f"{_shape_tree(guess)} for `h0` {_shape_tree(h0)}"
            )
        for g, h in zip(g_leaves, h_leaves):
            if jnp.iscomplexobj(g) and not jnp.iscomplexobj(h):
                raise ValueError(
                    f"pscan.recurrence: `guess` is complex ({jnp.result_type(g)}) but the "
                    f"states are real (`h0` has dtype {h.dtype})"
                )
        guess_flat = jax.vmap(
            lambda g: to_flat(ravel_pytree(g)[0]).astype(h0_flat.dtype)
        )(guess)
    restart, valid = segment_masks(
        "recurrence",
        steps,
        resets,
        length,
        reverse=reverse,
        axis_name=axis_name,
    )
    if reverse:  # solved forward in processing order, returned in time order
        xs, restart, valid, guess_flat = _flip((xs, restart, valid, guess_flat))
    if restart is None and valid is None:
        problem = Problem(step, cell, xs, h0_flat, project, guess_flat, throw)
    else:
        problem = _segmented(
            step, project, cell, xs, h0_flat, guess_flat, restart, valid, throw
        )
    # with `throw`, the solver raises if it did not converge (see `Problem.throw`)
    hs_flat, result, stats = solver.solve(problem)
    hs = jax.vmap(unravel)(_flip(hs_flat) if reverse else hs_flat)
    return Solution(hs=hs, result=result, stats=stats)


def _flip(tree):
    """Every array of `tree` reversed along its leading (time) axis."""
    return jax.tree_util.tree_map(lambda x: jnp.flip(x, 0), tree)


def _segmented(step, project, cell, xs, h0, guess, restart, valid, throw) -> Problem:
    """The problem with per-step masks in its inputs: a step flagged `restart` starts
    from `h0` (a parameter of the step, so that its derivative counts every segment),
    a step not `valid` is the identity. The masks act on the state, never through
    the cell: a step's Jacobian across a reset is exactly zero, a padded step's the
    identity, in every solver."""
    flags = {"restart": restart, "valid": valid}
    flags = {k: v for k, v in flags.items() if v is not None}

    def real_input(x):
        # a padded step's input as zeros: what the cell does with it is discarded,
        # and so are its derivatives, but only if they are finite (a NaN-padded
        # series would make every gradient NaN, 0 * NaN)
        if valid is None:
            return x["z"]
        mask = lambda v: x["valid"].reshape(x["valid"].shape + (1,) * (v.ndim - 1))
        return jax.tree_util.tree_map(
            lambda v: jnp.where(mask(v), v, jnp.zeros((), v.dtype)), x["z"]
        )

    def masked_step(params, z, h):
        cell, h0 = params
        h_in = h if restart is None else jnp.where(z["restart"], h0, h)
        h_next = step(cell, z["z"] if project else real_input(z), h_in)
        return h_next if valid is None else jnp.where(z["valid"], h_next, h)

    masked_project = None
    if project is not None:
        masked_project = lambda params, x: {**x, "z": project(params[0], real_input(x))}
    inputs = {**flags, "z": xs}
    return Problem(
        masked_step,
        (cell, h0),
        inputs,
        h0,
        masked_project,
        guess,
        throw,
        resets=restart is not None,
    )


def raise_on_failure(hs: PyTree[Array], result: RESULTS) -> PyTree[Array]:
    """`hs`, raising at run time with `result`'s message if the solver did not
    converge. (Non-finite states are the sequential loop's own answer, not a failure:
    `RESULTS.nonfinite` is reported, never raised.)"""
    return result.error_if(hs, result == RESULTS.max_iters_reached)
