"""The implicit derivatives of the shooting solvers, forward and reverse.

At the solution the chunk starts are a fixed point `s[k+1] = F_k(s[k]; theta, x_k)`, and
the states are every chunk run from its start. Neither mode ever differentiates through
the iterations:

- forward (`_tangent`): the starts' tangent solves `s_dot[k+1] = J_k s_dot[k] + u[k]`,
  `s_dot[0] = h0_dot` (`J_k = dF_k/ds`, `u[k]` chunk k's end tangent from the parameters
  and inputs), then the chunk runs' JVP gives the states' tangent;
- reverse (`_cotangent`): with `ct_k` the cotangent of chunk k's states, it solves the
  transposed recurrence `mu[k] = c[k] + J_k^T mu[k+1]`, `c[k] = (d hs_k/d s_k)^T ct_k`,
  then one VJP of the chunk runs (end cotangents `mu[k+1]`) gives the cotangents of the
  parameters and inputs (an iteration for `mu` has them from its last VJP), and
  `mu[0]` that of `h0`.

Both boundary recurrences are one `boundary_solve`, with the Jacobian structure the
solver names (`solver.linearisation()`): an exact one (`DenseJacobian`) solved at once
with `pscan.linear_recurrence`, an approximate one (`DiagonalJacobian`) as the
preconditioner of an iteration, none (Picard) by iterating products with `J` alone.
Iteration `n` makes `n` chunks exact, so the iteration goes on until it converges, at
most K + 1 times (exact after K, in parallel; no second copy of the cell in the
program); with `fallback="sequential"` it stops after `max_iters` and falls back to
an exact sequential sweep over the chunks.

`_run` is a `custom_jvp` whose tangent is `_tangent`, handed to
`lax.custom_linear_solve` together with `_cotangent` as its transpose: reverse mode
saves only the inputs, the chunk starts and the states, and recomputes in the
backward pass.

Memory: for chunks of C > 1 steps the backward pulls the chunk runs back step by step
from their states, each step recomputed (`_pull_at_states`): no per-step residuals
(autodiff through `lax.scan` keeps every step's). Chunks of one step (DEER's) have no
loop: an iteration (quasi-DEER's) recomputes them in every product (`_runs(remat=True)`),
DEER's single product keeps their residuals. The backward never holds, at the same
time, the forward's temporaries or dense Jacobians and a pull's buffers (see
`_cotangent`).
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._associative import fold
from .._axis import (
    everywhere,
    global_rows,
    shift_backward,
    shift_forward,
    varies,
    varying,
    zeros_typed_like,
)
from .._chunking import chunk_length, from_chunks, to_chunks
from .._finite import finite_everywhere
from .._linear import linear_recurrence
from .._solution import RESULTS
from ._base import Problem, finite_result
from ._chunks import Chunks
from ._iterate import loop, scaled_change


class _Inputs(eqx.Module):
    """The differentiable inputs of a solve."""

    params: PyTree[Array]
    xs: PyTree[Array]
    h0: Array


class _Static(eqx.Module):
    """The rest of the problem: functions and the cell's non-array leaves."""

    step: object
    project: object
    params: PyTree
    resets: bool


def _problem(inputs: _Inputs, static: _Static, params=None) -> Problem:
    params = inputs.params if params is None else params
    return Problem(
        static.step,
        eqx.combine(params, static.params),
        inputs.xs,
        inputs.h0,
        static.project,
        resets=static.resets,
    )


def implicit_states(solver, problem: Problem, starts, result, stats):
    """`(hs, result, stats)` from the chunk starts of a finished iteration: every
    chunk run from its start, with the implicit derivative below. With
    `fallback="sequential"`, a solve that did not converge returns the sequential
    states themselves."""
    params, static_params = eqx.partition(problem.params, eqx.is_inexact_array)
    inputs = _Inputs(params, problem.xs, problem.h0)
    static = _Static(problem.step, problem.project, static_params, problem.resets)
    hs = _run(inputs, static, solver, starts, stats["fell_back"])
    # the states are the answer (the sequential ones after a fallback): whether they
    # are finite is read from them, wherever in a chunk the first non-finite one is
    # (on any device: one device's block alone would flag only its own)
    _, finite = finite_result(hs, solver.axis_name)
    if solver.fallback is None:
        finite = RESULTS.where(result == RESULTS.max_iters_reached, result, finite)
    return hs, finite, stats


def _run_chunks(inputs, static, solver, starts, fell_back):
    """`(states, starts)`: every chunk run from its start, or (when the solve fell
    back) the sequential states and the chunk starts they imply. The states in chunks,
    `(K, C, d)`, as the backward pass reads them (for a length that is not a multiple
    of the chunk size, no padded copy of the `(T, d)` states to make there); the
    padded steps of the last chunk hold its last real state, finite wherever the
    answer is (a step past the end could overflow, and the backward pass takes a VJP
    at every state)."""
    problem = _problem(inputs, static)
    c = solver.chunk_size
    chunks = Chunks(problem, c, solver.axis_name)

    def chunked():
        states = problem.scan_chunks(starts, chunks.xs)
        real = c - (states.shape[0] * c - problem.length)  # of the last chunk
        if real < c:  # written in place: the runs' buffer has no other reader yet
            last = states[-1, real - 1]
            states = states.at[-1, real:].set(
                jnp.broadcast_to(last, (c - real,) + last.shape)
            )
        return states, starts

    if solver.fallback is None:
        return chunked()

    def sequential():
        hs = problem.scan(problem.h0, problem.xs)[0]
        ends = hs[c - 1 :: c]
        starts_ = jnp.concatenate([problem.h0[None], ends[: starts.shape[0] - 1]])
        return to_chunks(hs, c, fill=hs[-1]), starts_

    return lax.cond(fell_back, sequential, chunked)


@eqx.filter_custom_jvp
def _run(inputs, static, solver, starts, fell_back):
    """The states `(T, d)` from the (converged) chunk starts."""
    states = _run_chunks(inputs, static, solver, starts, fell_back)[0]
    return from_chunks(states, _problem(inputs, static).length)


@_run.def_jvp
def _run_jvp(primals, tangents):
    """The implicit tangent, a linear map of the inputs' tangents whose transpose is
    the implicit adjoint. `lax.custom_linear_solve` carries the pair: with the
    identity as its matrix it is "a linear map with its own transpose" that JAX can
    batch, transpose and lower anywhere; reverse mode saves the inputs, the chunk
    starts and the states (in chunks, `_run_chunks`), and recomputes the rest in the
    backward pass."""
    inputs, static, solver, starts, fell_back = primals
    states, starts = _run_chunks(inputs, static, solver, starts, fell_back)
    hs = from_chunks(states, _problem(inputs, static).length)
    t_inputs = tangents[0]  # None where the tangent is a symbolic zero
    is_none = lambda t: t is None
    # every operand of `custom_linear_solve` must be linear in the tangents, the
    # placeholder for the states' tangent too: zero times one tangent
    first = jax.tree_util.tree_leaves(t_inputs)[0]
    placeholder = jnp.zeros_like(hs) + (0 * jnp.sum(first)).real.astype(hs.dtype)

    # `custom_linear_solve` traces both maps now and runs them later: inside
    # `shard_map` (variance checks on) the residuals they close over are then typed
    # as varying across the devices, so they are traced that way
    if solver.axis_name is not None:
        inputs = jax.tree_util.tree_map(lambda x: _varying(x, solver.axis_name), inputs)
    # `custom_linear_solve` would differentiate its maps as if they were an inverse
    # (through the matrix only): a second derivative would silently miss terms
    inputs, starts = jax.tree_util.tree_map(_first_order_only, (inputs, starts))

    def forward(_, b):
        zeros = lambda t, x: (
            jnp.zeros_like(x) if is_none(t) and eqx.is_inexact_array(x) else t
        )
        t = jax.tree_util.tree_map(zeros, b[0], inputs, is_leaf=is_none)
        t_hs = _tangent(inputs, static, solver, starts, t)
        return jax.tree_util.tree_map(jnp.zeros_like, b[0]), t_hs

    def transpose(_, ct):
        ct_inputs = _cotangent(inputs, static, solver, starts, states, ct[1])
        keep = lambda t, c: None if is_none(t) else c
        ct_inputs = jax.tree_util.tree_map(keep, t_inputs, ct_inputs, is_leaf=is_none)
        return ct_inputs, jnp.zeros_like(ct[1])

    # The matrix is the identity, yet it reads every residual of the maps through
    # `_first_order_only` (times zero, never run: the solve's forward and transpose
    # run `forward` and `transpose` alone). `custom_linear_solve` differentiates the
    # constants of its matrix and drops those of `forward` and `transpose`: where a
    # second derivative reaches the residuals as values of a compiled call's inputs
    # (`jax.hessian(jax.jit(f))`), the guard above never sees an outer tracer, and the
    # second derivative came out as zeros; through the matrix it is refused there too
    residuals = [
        x
        for x in jax.tree_util.tree_leaves((inputs, starts, states))
        if eqx.is_inexact_array(x)
    ]

    def identity(v):
        anchor = sum(jnp.sum(_first_order_only(x)).real for x in residuals)
        # across devices, summed over them: typed as the same on every device, so
        # that the identity keeps each tangent's type (varying or not)
        anchor = everywhere(anchor, solver.axis_name, lax.psum)
        one = lambda x: x * (1 + 0 * anchor).astype(x.dtype)
        return jax.tree_util.tree_map(one, v)

    b = (t_inputs, placeholder)
    _, t_hs = lax.custom_linear_solve(identity, b, forward, transpose)
    return hs, t_hs


def _split_xs(xs_chunks):
    """`(floating, rest)`: the inputs that have tangents, and the others."""
    return eqx.partition(xs_chunks, eqx.is_inexact_array)


def _runs(inputs, static, rest, emit=True, remat=False):
    """`runs(params, starts, xs)`: every chunk from its start, vectorised, the
    parameters unbatched (so that their tangents and cotangents are summed over the
    chunks inside one product, never copied per chunk).

    Chunks of one step (DEER's) are run in 8 groups, one after another: a product's
    temporaries are then those of T / 8 steps, not of all T at once (chunks of
    C > 1 steps already run one step of each chunk at a time, T / C at once). With
    `remat`, a VJP of them keeps no residuals: each group's steps are recomputed in
    every product, as `_pull_at_states` does for longer chunks."""

    def runs(params, starts, floating):
        xs_chunks = eqx.combine(floating, rest)
        one = lambda a: _problem(inputs, static, params).scan(*a, emit=emit)
        if remat:
            one = jax.checkpoint(one)
        if chunk_length(xs_chunks) == 1:
            # `lax.map`, not `map_in_groups` (whose in-place writes spare the copy of
            # the outputs when 8 does not divide K): under `jax.vjp` that loop held
            # more (quasi-DEER's gradient, T = 524288: 658 against 514 MiB)
            batch = -(-starts.shape[0] // 8)
            return lax.map(one, (starts, xs_chunks), batch_size=batch)
        return jax.vmap(one)((starts, xs_chunks))

    return runs


def _pull_at_states(inputs, static, primal, rest, states, ct_chunks):
    """`m -> (ct_params, ct_starts, ct_floating)`: the VJP of every chunk run from its
    start (`primal = (params, starts, floating)`), with cotangents `ct_chunks` on its
    states and `m` on its end, run backward over the steps of all chunks at once from
    the states the runs gave (`states`, `(K, C, d)`): each step's VJP is taken at the
    state before it, recomputing the step, so nothing of the forward pass is kept but
    the states themselves. Autodiff of the runs keeps every step's residuals and runs
    the chunks again to make them: on a GRU 1 -> 32 at T = 100000 (chunks of 128) that
    pull alone took 123 MiB of temporaries against 1 here and twice the time, and the
    gradients of Picard and Newton 136-137 MiB against 39-49. A product costs a
    recomputed step more than one from residuals: past about 7 products (a boundary
    iteration that needs many) the residuals' way would be faster, not lighter."""
    params, starts, floating = primal
    # the steps' inputs `z`: the inexact ones differentiable (one projection)
    split = lambda p, f: eqx.partition(
        _problem(inputs, static, p).project_chunks(eqx.combine(f, rest)),
        eqx.is_inexact_array,
    )
    z_float, pull_z, z_rest = jax.vjp(split, params, floating, has_aux=True)
    # the state before step `c` of every chunk, read in place: the chunk's start for
    # `c = 0`, else its state `c - 1` (a concatenation would copy all T states)
    steps = jnp.arange(states.shape[1])[None]

    def back(carry, x):
        lam, ct_params = carry
        zf, zr, c, ct = x
        previous = lax.dynamic_index_in_dim(states, jnp.maximum(c[0] - 1, 0), 1, False)
        h = jnp.where(c[0] == 0, starts, previous)

        def advance(p, zf, h):
            return _problem(inputs, static, p).step_chunks(h, eqx.combine(zf, zr))

        _, vjp = jax.vjp(advance, params, zf, h)
        ct_p, ct_z, lam = vjp(lam + ct)
        return (lam, jax.tree_util.tree_map(jnp.add, ct_params, ct_p)), ct_z

    def pull(m):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        ct_z, (ct_starts, ct_params) = fold(
            back, (m, zeros), (z_float, z_rest, steps, ct_chunks), axis=1, reverse=True
        )
        more_params, ct_floating = pull_z(ct_z)
        ct_params = jax.tree_util.tree_map(jnp.add, ct_params, more_params)
        return ct_params, ct_starts, ct_floating

    return pull


def _tangent(inputs, static, solver, starts, t):
    """The tangent of the states for tangents `t` (an `_Inputs`) of the inputs:
    `s_dot[k+1] = J_k s_dot[k] + u[k]`, `s_dot[0] = t.h0`, with `u[k]` chunk k's end
    tangent from the parameters and inputs alone; then the chunk runs' tangent."""
    problem = _problem(inputs, static)
    chunks = Chunks(problem, solver.chunk_size, solver.axis_name)
    floating, rest = _split_xs(chunks.xs)
    zero = jax.tree_util.tree_map(lambda x: jnp.zeros((), x.dtype), t.xs)
    t_floating = to_chunks(t.xs, solver.chunk_size, fill=zero)
    runs_to_end = _runs(inputs, static, rest, emit=False)
    ends = lambda *args: runs_to_end(*args)[1]
    primal = (inputs.params, starts, floating)
    # `push(m)[k] = u[k] + J_k m[k]`, for the tangents `m` of the chunk starts
    push = lambda m: jax.jvp(ends, primal, (t.params, m, t_floating))[1]

    def push_one(m, chunk):  # one chunk's `push`, for the exact sweep
        s, floating_k, rest_k, t_k = chunk

        def end(p, s, x):
            xs_k = eqx.combine(x, rest_k)
            return _problem(inputs, static, p).scan(s, xs_k, emit=False)[1]

        return jax.jvp(end, (inputs.params, s, floating_k), (t.params, m, t_k))[1]

    jac = _boundary_jacobians(solver, chunks, starts)
    per_chunk = (starts, floating, rest, t_floating)
    t_ends = boundary_solve(
        solver, jac, push, push_one, per_chunk, t.h0, resets=problem.resets
    )
    s_dot = shift_forward(t_ends, t.h0, solver.axis_name)
    runs = lambda *a: _runs(inputs, static, rest)(*a)[0]
    hs_dot = jax.jvp(runs, primal, (t.params, s_dot, t_floating))[1]
    return from_chunks(hs_dot, problem.length)


def _boundary_jacobians(solver, chunks, starts):
    """The chunk Jacobians of the derivatives' boundary recurrence (None without a
    structure). Exact ones solve it at once: at the solver's `precision`, as the
    exact transposes are what make the derivative exact. Approximate ones only
    precondition an iteration of exact products (as the forward step, its answer
    is the products' fixed point): at the solver's Jacobian precision (on a TPU v5e,
    `Newton(chunk_size=128, jacobian="diagonal")`'s gradient 1.17x faster, the
    gradient the same; docs/benchmarks.md)."""
    structure = solver.linearisation()
    if structure is None:
        return None
    precision = None if structure.exact else solver.jacobian_matrix_precision()
    return chunks.linearise(structure, starts, precision)


@jax.custom_jvp
def _first_order_only(x):
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError(
        "pscan: derivatives of second order (and higher) through the iterating solvers "
        "(`Picard`, `Newton`, `ELK`, your own) are not implemented; use "
        "`pscan.Sequential` for them"
    )


def _varying(x, axis_name):
    if not eqx.is_array(x) or varies(x, axis_name):
        return x
    return varying(x, axis_name)


def _cotangent(inputs, static, solver, starts, states, ct_hs):
    """The implicit adjoint: the cotangents (an `_Inputs`) of the inputs for the
    cotangent `ct_hs` of the states (the chunk runs from `starts`, `states` in chunks
    `(K, C, d)` as `_run_chunks` gives them). (Across
    devices, the cotangent of a replicated input is summed over them by JAX's
    transposition of the `custom_linear_solve`.)"""
    problem = _problem(inputs, static)
    axis = solver.axis_name
    c = solver.chunk_size
    chunks = Chunks(problem, c, axis)
    floating, rest = _split_xs(chunks.xs)
    ct_chunks = to_chunks(ct_hs, c, fill=jnp.zeros_like(ct_hs[0]))
    primal = (inputs.params, starts, floating)
    nan = lambda x: jnp.zeros_like(x) + jnp.nan
    unknown = lambda: jax.tree_util.tree_map(nan, (primal[0], primal[2], starts[0]))
    structure = solver.linearisation()
    per_chunk = (starts, chunks.xs, ct_chunks)

    def pull_one(m, chunk):  # one chunk's `pull`, for the exact sweep
        s, xs_k, ct_k = chunk
        _, vjp = jax.vjp(lambda s: problem.scan(s, xs_k), s)
        return vjp((ct_k, m))[0]

    def linearised(mu=None):
        # the VJP of every chunk run: `pull(m)[1][k] = c[k] + J_k^T m[k]`, with
        # `c[k] = (d hs_k / d s_k)^T ct_k`
        if c == 1:  # one step per chunk: no loop to run backward
            # an iteration (`mu` unknown) keeps no residuals: its memory is that of the
            # quasi-Newton methods' use; the exact path pulls back once, from them
            remat = mu is None
            _, vjp = jax.vjp(_runs(inputs, static, rest, remat=remat), *primal)
            pull = lambda m: vjp((ct_chunks, m))
        else:
            pull = _pull_at_states(inputs, static, primal, rest, states, ct_chunks)
        if mu is None:
            jac = _boundary_jacobians(solver, chunks, starts)
            jac = None if jac is None else jac.transpose()
            # the products' cotangents of the parameters and inputs come along
            split = lambda ct: (ct[1], (ct[0], ct[2]))
            more = lambda m: split(pull(m))
            mu, (ct_params, ct_xs) = boundary_solve(
                solver, jac, more, pull_one, per_chunk, None, extra=True
            )
            return ct_params, ct_xs, mu[0]
        ct_params, _, ct_xs = pull(shift_backward(mu, axis))
        return ct_params, ct_xs, mu[0]

    def exact():
        # an exact Jacobian gives `mu` before the chunk runs are pulled back: the K
        # Jacobians and that pull's buffers are never alive together. `c[k]` is one
        # more row of the same forward-mode pass: the derivative of the chunk's
        # weighted sum of states `sum(ct_k * hs_k)` (accumulated as it runs)
        def end_and_weighted(s, xs_ct):
            weighted, end = problem.scan(s, xs_ct[0], weights=xs_ct[1])
            return end, weighted

        jac_t, rhs = structure.linearise(
            end_and_weighted, starts, (chunks.xs, ct_chunks), transposed=True
        )
        mu = boundary_solve(solver, jac_t, None, pull_one, per_chunk, None, rhs=rhs)
        return lax.cond(finite_everywhere(mu, axis), lambda: linearised(mu), unknown)

    # Each stage runs in a conditional on what it needs (finite chunk starts, finite
    # `mu`): XLA allocates a branch's buffers only when it runs, never during the
    # forward pass or the exact solve, so the peak memory is the larger of the
    # stages', not their sum. Without finite starts (or `mu`) there is no
    # derivative: every cotangent is NaN.
    backward = exact if structure is not None and structure.exact else linearised
    ct_params, ct_xs, ct_h0 = lax.cond(
        finite_everywhere(starts, axis), backward, unknown
    )
    ct_xs = from_chunks(ct_xs, problem.length)
    if axis is not None:  # h0 enters on the first device only
        ct_h0 = jnp.where(lax.axis_index(axis) == 0, ct_h0, 0)
    return _Inputs(ct_params, ct_xs, ct_h0)


def boundary_solve(
    solver,
    jac,
    affine,
    affine_one,
    per_chunk,
    edge,
    rhs=None,
    extra=False,
    resets=False,
):
    """The boundary recurrence of a derivative, over the chunks: forward (the tangent,
    `edge` its value before the first chunk)

        y[k] = affine_k(y[k-1]),  y[-1] = edge,

    or reverse (the adjoint, `edge=None`): `y[k] = affine_k(y[k+1])`, `y[K] = 0`, where
    `affine_k(m) = r[k] + L_k m` with `L_k` the chunk Jacobian (its transpose for the
    adjoint). `y` is the chunk ends' tangent, or the chunk starts' cotangent.

    **Arguments:**

    - `jac`: None, or `L` as an `AbstractJacobian`: exact ones are solved at once,
        others precondition an iteration of exact products.
    - `affine`: `m -> r + L m` for every chunk at once, `(K, d) -> (K, d)` (not
        needed, None, when `jac` is exact and `rhs` given).
    - `affine_one`: `(m, chunk) -> affine_k(m)` for one chunk (`chunk` a slice of
        `per_chunk`): the exact sequential sweep that the iteration falls back to
        after `max_iters` with `fallback="sequential"` (without it, the iteration
        goes on, at most K + 1 times: exact after K).
    - `per_chunk`: a pytree with a leading axis K, what `affine_one` reads.
    - `edge`: the tangent's initial value, or None for the adjoint.
    - `rhs`: `r`, if already known (else `affine(0)`).
    - `extra`: whether `affine` returns `(r + L m, more)`: then the result is `(y,
        more)`, `more` from the last product the iteration took (at `y` within the
        tolerances; exactly at `y` after the sweep): one product fewer to compile.
    - `resets`: `Problem.resets`: the tangent's exact solve then treats a chunk whose
        dense Jacobian is zero as a reset, so that a NaN tangent before it stops there
        (the adjoint's NaN makes every cotangent NaN anyway: `_cotangent`).
    """
    axis = solver.axis_name
    reverse = edge is None
    like = per_chunk[0]
    zero = jnp.zeros_like(like[0])
    edge = zero if reverse else edge
    if reverse:
        shift = lambda y: shift_backward(y, axis)
    else:
        shift = lambda y: shift_forward(y, edge, axis)

    def solve(r, start):  # `y[k] = r[k] + L_k y[k -+ 1]` exactly, for `jac`
        a = jac.coefficients()
        if reverse and axis is None:  # L_{K-1} multiplies y[K] = 0 (never inf * 0)
            a = a.at[-1].set(0)
        restart = None
        if resets and not reverse and a.ndim == r.ndim + 1:
            # a zero Jacobian (a reset in the chunk) is the same reset again: `a`
            # stays zero, `r` gains `0 @ start`, and the solve guards it
            restart = jnp.all(a == 0, axis=(-2, -1))
        return linear_recurrence(
            a, r, start, reverse=reverse, axis_name=axis, resets=restart
        )

    if jac is not None and jac.exact:
        return solve(affine(jnp.zeros_like(like)) if rhs is None else rhs, edge)
    # `affine` may return more than `y`: what else its product computes, kept from
    # the last one
    product = affine if extra else (lambda m: (affine(m), None))
    if jac is None:
        sweep = lambda y: product(shift(y))
    else:  # the structured part solved exactly, the rest iterated

        def sweep(y):
            new, rest = product(shift(y))
            return y + solve(new - y, zero), rest

    def body(carry):
        y, _ = carry
        new, rest = sweep(y)
        size = everywhere(jnp.max(jnp.abs(new), initial=0.0), axis, lax.pmax)
        change = scaled_change(new, y, solver.rtol, solver.atol * size)
        return (new, rest), everywhere(change, axis, lax.pmax)

    # iterated from zero until it changes by at most `atol * max|y| + rtol * |y|`
    # (tangents and cotangents have no scale of their own). Iteration `n` makes the
    # last (the tangent: first) `n` chunks exact, over every device's chunks: after
    # all of them, the iteration is the exact sweep, done in parallel
    zeros = jnp.zeros_like(like)
    rest = jax.eval_shape(lambda: product(zeros)[1])
    init = (zeros, jax.tree_util.tree_map(lambda r: zeros_typed_like(r, axis), rest))
    dtype = like.real.dtype
    if solver.fallback is None:
        chunks = global_rows(like.shape[0], axis)[1]
        out = loop(body, init, chunks + 1, dtype)[0]
        return out if extra else out[0]
    # `fallback="sequential"`: at most `max_iters` iterations, then the sweep itself
    # (one chunk after another, as the forward pass's fallback)
    out, _, change = loop(body, init, solver.max_iters, dtype)

    def exact():
        y = _exact_sweep(affine_one, per_chunk, edge, reverse)
        return y, (product(shift(y))[1] if extra else None)

    out = lax.cond(change <= 1, lambda: out, exact)
    return out if extra else out[0]


def _exact_sweep(affine_one, per_chunk, edge, reverse):
    """`y[k] = affine_one(y[k -+ 1], chunk k)` chunk after chunk: exact, sequential
    over the chunks (on one device: `fallback="sequential"` excludes `axis_name`)."""
    step = lambda m, chunk: (lambda y: (y, y))(affine_one(m, chunk))
    return lax.scan(step, edge, per_chunk, reverse=reverse)[1]
