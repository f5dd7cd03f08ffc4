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
  parameters and inputs, and `mu[0]` that of `h0`.

Both boundary recurrences are solved as the solver's forward pass solved its own
(`solver._linearise`): dense chunk Jacobians at once with `pscan.linear_recurrence`,
diagonal ones as a preconditioner of an iteration, none (Picard) by iterating products
with `J` alone; an iteration that does not converge falls back to an exact sweep over
the chunks. `_run` is a `custom_jvp` whose tangent is `_tangent`, handed to
`lax.custom_linear_solve` together with `_cotangent` as its transpose: reverse mode
saves only the inputs and the chunk starts and recomputes in the backward pass.

Memory: the backward keeps the per-step residuals of one linearisation of the chunk
runs (those of autodiff through `lax.scan`) and never, at the same time, the forward's
temporaries or dense Jacobians (see `_cotangent`).
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._axis import (
    everywhere,
    shift_backward,
    shift_forward,
    varies,
    varying,
)
from .._chunking import from_chunks, to_chunks
from .._linear import linear_recurrence
from .._solution import RESULTS
from ._base import Problem, chunk_xs, finite_result
from ._iterate import chunk_end, run_chunks, scaled_change, shooting_forward


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


def _problem(inputs: _Inputs, static: _Static, params=None) -> Problem:
    params = inputs.params if params is None else params
    return Problem(
        static.step,
        eqx.combine(params, static.params),
        inputs.xs,
        inputs.h0,
        static.project,
    )


def shooting_solve(solver, problem: Problem):
    """`(hs, result, stats)` of a shooting solver, with the implicit gradient.

    The iteration sees the problem without its derivatives (it is never
    differentiated); `hs` is the run of every chunk from the converged chunk starts,
    whose derivative is the implicit one below. With `fallback="sequential"`, a solve
    that did not converge returns the sequential states themselves.
    """
    frozen = jax.tree_util.tree_map(
        lambda x: lax.stop_gradient(x) if eqx.is_array(x) else x, problem
    )
    starts, result, stats = shooting_forward(solver, frozen)
    params, static_params = eqx.partition(problem.params, eqx.is_inexact_array)
    inputs = _Inputs(params, problem.xs, problem.h0)
    static = _Static(problem.step, problem.project, static_params)
    hs = _run(inputs, static, solver, starts, stats["fell_back"])
    # the states are the answer (the sequential ones after a fallback): whether they
    # are finite is read from them, wherever in a chunk the first non-finite one is
    _, finite = finite_result(hs)
    if solver.fallback is None:
        finite = RESULTS.where(result == RESULTS.max_iters_reached, result, finite)
    return hs, finite, stats


def _run_chunks(inputs, static, solver, starts, fell_back):
    """`(hs, starts)`: every chunk run from its start, or (when the solve fell back)
    the sequential states and the chunk starts they imply."""
    problem = _problem(inputs, static)
    xs_chunks = chunk_xs(problem, solver.chunk_size)
    chunked = lambda: (run_chunks(problem, starts, xs_chunks), starts)
    if solver.fallback is None:
        return chunked()

    def sequential():
        hs = problem.scan(problem.h0, problem.xs)[0]
        ends = hs[solver.chunk_size - 1 :: solver.chunk_size]
        return hs, jnp.concatenate([problem.h0[None], ends[: starts.shape[0] - 1]])

    return lax.cond(fell_back, sequential, chunked)


@eqx.filter_custom_jvp
def _run(inputs, static, solver, starts, fell_back):
    """The states `(T, d)` from the (converged) chunk starts."""
    return _run_chunks(inputs, static, solver, starts, fell_back)[0]


@_run.def_jvp
def _run_jvp(primals, tangents):
    """The implicit tangent, a linear map of the inputs' tangents whose transpose is
    the implicit adjoint. `lax.custom_linear_solve` carries the pair: with the
    identity as its matrix it is "a linear map with its own transpose" that JAX can
    batch, transpose and lower anywhere; reverse mode saves only the inputs and the
    chunk starts, and recomputes in the backward pass."""
    inputs, static, solver, starts, fell_back = primals
    hs, starts = _run_chunks(inputs, static, solver, starts, fell_back)
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
        ct_inputs = _cotangent(inputs, static, solver, starts, ct[1])
        keep = lambda t, c: None if is_none(t) else c
        ct_inputs = jax.tree_util.tree_map(keep, t_inputs, ct_inputs, is_leaf=is_none)
        return ct_inputs, jnp.zeros_like(ct[1])

    b = (t_inputs, placeholder)
    _, t_hs = lax.custom_linear_solve(lambda v: v, b, forward, transpose)
    return hs, t_hs


def _split_xs(xs_chunks):
    """`(floating, rest)`: the inputs that have tangents, and the others."""
    return eqx.partition(xs_chunks, eqx.is_inexact_array)


def _runs(inputs, static, rest, emit=True):
    """`runs(params, starts, xs)`: every chunk from its start, vectorised, the
    parameters unbatched (so that their tangents and cotangents are summed over the
    chunks inside one product, never copied per chunk).

    Chunks of one step (DEER's) are run in 8 groups, one after another: a product's
    temporaries are then those of T / 8 steps, not of all T at once (chunks of
    C > 1 steps already run one step of each chunk at a time, T / C at once)."""

    def runs(params, starts, floating):
        xs_chunks = eqx.combine(floating, rest)
        one = lambda a: _problem(inputs, static, params).scan(*a, emit=emit)
        if jax.tree_util.tree_leaves(xs_chunks)[0].shape[1] == 1:
            batch = -(-starts.shape[0] // 8)
            return lax.map(one, (starts, xs_chunks), batch_size=batch)
        return jax.vmap(one)((starts, xs_chunks))

    return runs


def _tangent(inputs, static, solver, starts, t):
    """The tangent of the states for tangents `t` (an `_Inputs`) of the inputs:
    `s_dot[k+1] = J_k s_dot[k] + u[k]`, `s_dot[0] = t.h0`, with `u[k]` chunk k's end
    tangent from the parameters and inputs alone; then the chunk runs' tangent."""
    problem = _problem(inputs, static)
    c = solver.chunk_size
    floating, rest = _split_xs(chunk_xs(problem, c))
    zero = jax.tree_util.tree_map(lambda x: jnp.zeros((), x.dtype), t.xs)
    t_floating = to_chunks(t.xs, c, fill=zero)
    runs_to_end = _runs(inputs, static, rest, emit=False)
    ends = lambda *args: runs_to_end(*args)[1]
    primal = (inputs.params, starts, floating)
    # `push(m)[k] = u[k] + J_k m[k]`
    push = lambda m: jax.jvp(ends, primal, (t.params, m, t_floating))[1]

    def push_one(m, chunk):  # one chunk's `push`, for the exact sweep
        s, floating_k, rest_k, t_k = chunk

        def end(p, s, x):
            xs_k = eqx.combine(x, rest_k)
            return _problem(inputs, static, p).scan(s, xs_k, emit=False)[1]

        return jax.jvp(end, (inputs.params, s, floating_k), (t.params, m, t_k))[1]

    chunks = (starts, floating, rest, t_floating)
    s_dot = tangent_starts(solver, problem, push, push_one, t.h0, chunks)
    runs = lambda *a: _runs(inputs, static, rest)(*a)[0]
    hs_dot = jax.jvp(runs, primal, (t.params, s_dot, t_floating))[1]
    return from_chunks(hs_dot, problem.length)


@jax.custom_jvp
def _first_order_only(x):
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError(
        "pscan: derivatives of second order (and higher) through `Picard` and `Newton` "
        "are not implemented; use `pscan.Sequential` for them"
    )


def _varying(x, axis_name):
    if not eqx.is_array(x) or varies(x, axis_name):
        return x
    return varying(x, axis_name)


def _cotangent(inputs, static, solver, starts, ct_hs):
    """The implicit adjoint: the cotangents (an `_Inputs`) of the inputs for the
    cotangent `ct_hs` of the states. (Across devices, the cotangent of a replicated
    input is summed over them by JAX's transposition of the `custom_linear_solve`.)"""
    problem = _problem(inputs, static)
    axis = solver.axis_name
    c = solver.chunk_size
    xs_chunks = chunk_xs(problem, c)
    floating, rest = _split_xs(xs_chunks)
    ct_chunks = to_chunks(ct_hs, c, fill=jnp.zeros_like(ct_hs[0]))
    primal = (inputs.params, starts, floating)
    nan = lambda x: jnp.zeros_like(x) + jnp.nan
    unknown = lambda: jax.tree_util.tree_map(nan, (primal[0], primal[2], starts[0]))

    def linearised(mu=None):
        # one linearisation of every chunk run, its residuals shared by every product:
        # `pull(m)[1][k] = c[k] + J_k^T m[k]`, with `c[k] = (d hs_k / d s_k)^T ct_k`
        _, vjp = jax.vjp(_runs(inputs, static, rest), *primal)
        pull = lambda m: vjp((ct_chunks, m))
        if mu is None:
            mu = adjoint_starts(
                solver, problem, lambda m: pull(m)[1], starts, xs_chunks, ct_chunks
            )
        ct_params, _, ct_xs = pull(shift_backward(mu, axis))
        return ct_params, ct_xs, mu[0]

    def dense():
        # dense Jacobians give `mu` before the chunk runs are linearised: the K
        # Jacobians and the runs' residuals are never alive together
        mu = dense_adjoint_starts(solver, problem, starts, xs_chunks, ct_chunks)
        return lax.cond(_all_finite(mu, axis), lambda: linearised(mu), unknown)

    # Each stage runs in a conditional on what it needs (finite chunk starts, finite
    # `mu`): XLA allocates a branch's buffers only when it runs, never during the
    # forward pass or the dense solve, so the peak memory is the larger of the
    # stages', not their sum. Without finite starts (or `mu`) there is no
    # derivative: every cotangent is NaN.
    backward = dense if solver._jacobian == "dense" else linearised
    ct_params, ct_xs, ct_h0 = lax.cond(_all_finite(starts, axis), backward, unknown)
    ct_xs = from_chunks(ct_xs, problem.length)
    if axis is not None:  # h0 enters on the first device only
        ct_h0 = jnp.where(lax.axis_index(axis) == 0, ct_h0, 0)
    return _Inputs(ct_params, ct_xs, ct_h0)


def _all_finite(x, axis):
    """Whether every entry of `x` is finite, on every device."""
    finite = jnp.all(jnp.isfinite(x)).astype(jnp.int32)
    return everywhere(finite, axis, lax.pmin) > 0


def tangent_starts(solver, problem, push, push_one, t_h0, chunks) -> Array:
    """`s_dot` with `s_dot[0] = t_h0`, `s_dot[k+1] = push(s_dot)[k]`, where
    `push(m)[k] = u[k] + J_k m[k]`: the forward twin of `adjoint_starts` (same
    Jacobians, iteration and exact sweep, in forward time). `chunks` is
    `(starts, floating inputs, other inputs, their tangents)`, chunk by chunk;
    `push_one(m, chunk)` is one chunk's `push`."""
    axis = solver.axis_name
    starts, floating, rest = chunks[:3]
    shift = lambda e: shift_forward(e, t_h0, axis)
    end = lambda s, xs_k: chunk_end(problem, s, xs_k)
    jac = solver._linearise(end, starts, eqx.combine(floating, rest))
    if solver._jacobian == "dense":  # the exact recurrence at once
        return shift(
            linear_recurrence(jac, push(jnp.zeros_like(starts)), t_h0, axis_name=axis)
        )
    sweep = lambda m: shift(push(m))
    if jac is not None:  # quasi-Newton: m[k] = r[k] + D_{k-1} m[k-1] solved exactly
        zero = jnp.zeros_like(starts)
        a = shift_forward(jac, zero[0], axis)
        solve = lambda r: linear_recurrence(a, r, zero[0], axis_name=axis)
        sweep = lambda m: m + solve(shift(push(m)) - m)
    s_dot, converged = _iterate_linear(solver, sweep, starts)

    def exact():  # chunk after chunk; across devices, one round per device
        step = lambda m, chunk: (push_one(m, chunk), m)
        local = lambda incoming: lax.scan(step, incoming, chunks)
        if axis is None:
            return local(t_h0)[1]
        incoming = lambda last: shift_forward(last[None], t_h0, axis)[0]
        rounds = lambda _, carry: local(incoming(carry[0]))
        return lax.fori_loop(0, lax.psum(1, axis), rounds, local(t_h0))[1]

    return lax.cond(converged, lambda: s_dot, exact)


def dense_adjoint_starts(solver, problem, starts, xs_chunks, ct_chunks) -> Array:
    """`mu` with `mu[k] = c[k] + J_k^T mu[k+1]` (`mu[K] = 0`) from dense chunk
    Jacobians, at once. `c[k] = (d hs_k / d s_k)^T ct_chunks[k]` is one more row of
    the same forward-mode pass: the Jacobian of the chunk's weighted sum of states
    `sum(ct_k * hs_k)` (accumulated as the chunk runs, never stored)."""
    axis = solver.axis_name

    def end_and_weighted(s, xs_ct):
        weighted, end = problem.scan(s, xs_ct[0], weights=xs_ct[1])
        return end, weighted

    jac, c = solver._linearise(
        end_and_weighted, starts, (xs_chunks, ct_chunks), transposed=True
    )
    return _reverse_solve(jac, axis)(c)


def _reverse_solve(jac, axis):
    """`r -> m` with `m[k] = r[k] + jac[k] m[k+1]`, `m[K] = 0`: the boundary
    recurrence of the adjoint for transposed chunk Jacobians `jac` (dense or
    diagonal), across devices with `axis`."""
    if axis is None:  # the last chunk's J multiplies mu[K] = 0 (never inf * 0)
        jac = jac.at[-1].set(0)
    return lambda r: linear_recurrence(jac, r, reverse=True, axis_name=axis)


def adjoint_starts(solver, problem, pull, starts, xs_chunks, ct_chunks) -> Array:
    """`mu` with `mu[k] = c[k] + J_k^T mu[k+1]` (`mu[K] = 0`) by iteration, where
    `pull(m)[k] = c[k] + J_k^T m[k]`, `c[k] = (d hs_k / d s_k)^T ct_chunks[k]`.

    With the diagonal Jacobians of a quasi-Newton forward pass
    (`solver._linearise`), the diagonal part is solved exactly and the rest iterated;
    without (Picard), `mu <- pull(shift(mu))`. The iterations use only `pull` (no
    Jacobian matrix), stop at the solver's tolerances and fall back to an exact
    sweep over the chunks when they do not converge in `max_iters`.
    """
    axis = solver.axis_name
    shift = lambda m: shift_backward(m, axis)
    end = lambda s, xs_k: chunk_end(problem, s, xs_k)
    jac = solver._linearise(end, starts, xs_chunks, transposed=True)
    if jac is None:
        sweep = lambda mu: pull(shift(mu))
    else:  # quasi-Newton: the diagonal part solved exactly, the rest iterated
        solve = _reverse_solve(jac, axis)
        sweep = lambda mu: mu + solve(pull(shift(mu)) - mu)
    mu, converged = _iterate_linear(solver, sweep, starts)
    return lax.cond(
        converged,
        lambda: mu,
        lambda: _exact_sweep(solver, problem, starts, xs_chunks, ct_chunks),
    )


def _iterate_linear(solver, sweep, starts):
    """`sweep` from zero until it changes its value `mu` by at most `atol * max|mu| +
    rtol * |mu|` (tangents and cotangents have no scale of their own):
    `(mu, converged)`."""
    axis = solver.axis_name

    def cond(carry):
        _, it, change = carry
        return (it < solver.max_iters) & (change > 1)

    def body(carry):
        mu, it, _ = carry
        new = sweep(mu)
        size = everywhere(jnp.max(jnp.abs(new), initial=0.0), axis, lax.pmax)
        change = scaled_change(new, mu, solver.rtol, solver.atol * size)
        change = everywhere(change, axis, lax.pmax)
        return new, it + 1, change

    inf = jnp.array(jnp.inf, starts.real.dtype)
    mu, _, change = lax.while_loop(cond, body, (jnp.zeros_like(starts), 0, inf))
    return mu, change <= 1


def _exact_sweep(solver, problem, starts, xs_chunks, ct_chunks):
    """The adjoint recurrence chunk after chunk, `mu[k]` by the VJP of a rerun of
    chunk k with cotangents `(ct_chunks[k], mu[k+1])`: exact, sequential over the
    chunks. Across devices, each device sweeps its block from the next device's first
    value, as many times as there are devices."""

    def local(incoming):
        def step(m, inputs):
            s, xs_k, ct_k = inputs
            _, vjp = jax.vjp(lambda s: problem.scan(s, xs_k), s)
            mu_k = vjp((ct_k, m))[0]
            return mu_k, mu_k

        _, mu = lax.scan(step, incoming, (starts, xs_chunks, ct_chunks), reverse=True)
        return mu

    zero = jnp.zeros_like(starts[0])
    axis = solver.axis_name
    if axis is None:
        return local(zero)
    devices = lax.psum(1, axis)
    incoming = lambda mu: shift_backward(mu, axis)[-1]
    return lax.fori_loop(0, devices, lambda _, mu: local(incoming(mu)), local(zero))
