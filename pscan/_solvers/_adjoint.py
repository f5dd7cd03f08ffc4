"""The implicit adjoint of the shooting solvers.

At the solution the chunk starts are a fixed point `s[k+1] = F_k(s[k]; theta, x_k)`. The
backward pass never differentiates through the iterations. With `ct_k` the cotangent of
chunk k's states, it solves the transposed boundary recurrence

    mu[k] = c[k] + J_k^T mu[k+1],   c[k] = (d hs_k / d s_k)^T ct_k,   J_k = d F_k / d s_k,

a reverse-time dense linear recurrence over the K chunks (`pscan.linear_recurrence`,
split over devices with the solver's `axis_name`), then takes one vectorised VJP per
chunk whose end state's cotangent is `mu[k+1]`; that gives the cotangents of the
parameters and the inputs, and `mu[0]` is the cotangent of `h0`.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._axis import cotangent_like, everywhere, shift_backward
from .._chunking import from_chunks, to_chunks
from .._linear import linear_recurrence
from .._solution import RESULTS
from ._base import Problem, chunk_xs
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
    if solver.fallback is not None:
        finite = jnp.all(jnp.isfinite(lax.stop_gradient(hs)))
        result = RESULTS.where(finite, RESULTS.successful, RESULTS.nonfinite)
    return hs, result, stats


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


@eqx.filter_custom_vjp
def _run(inputs, static, solver, starts, fell_back):
    """The states `(T, d)` from the (converged) chunk starts."""
    return _run_chunks(inputs, static, solver, starts, fell_back)[0]


@_run.def_fwd
def _run_fwd(perturbed, inputs, static, solver, starts, fell_back):
    del perturbed
    return _run_chunks(inputs, static, solver, starts, fell_back)


@_run.def_bwd
def _run_bwd(starts, ct_hs, perturbed, inputs, static, solver, _, fell_back):
    del perturbed, fell_back
    problem = _problem(inputs, static)
    c = solver.chunk_size
    xs_chunks = chunk_xs(problem, c)
    if ct_hs is None:
        ct_hs = jnp.zeros((problem.length, *problem.h0.shape), problem.h0.dtype)
    ct_chunks = to_chunks(ct_hs, c, fill=jnp.zeros_like(ct_hs[0]))

    def runs(params, starts, xs_chunks):
        one = lambda s, xs_k: _problem(inputs, static, params).scan(s, xs_k)
        return jax.vmap(one)(starts, xs_chunks)

    # one linearisation of every chunk run, its residuals shared by every product
    # below; the parameters enter unbatched, so their cotangent is summed over the
    # chunks inside each product (never a per-chunk copy of the parameters)
    _, vjp = jax.vjp(runs, inputs.params, starts, xs_chunks)
    # `pull(m)[1][k] = c[k] + J_k^T m[k]`, with `c[k] = (d hs_k / d s_k)^T ct_k`
    pull = lambda m: vjp((ct_chunks, m))
    mu = adjoint_starts(
        solver, problem, lambda m: pull(m)[1], starts, xs_chunks, ct_chunks
    )
    ct_params, _, ct_xs = pull(shift_backward(mu, solver.axis_name))
    ct_xs = from_chunks(ct_xs, problem.length)
    ct_h0 = mu[0]
    axis = solver.axis_name
    if axis is not None:  # h0 enters on the first device only
        ct_h0 = jnp.where(lax.axis_index(axis) == 0, ct_h0, 0)
        ct_h0 = cotangent_like(ct_h0, inputs.h0, axis)
        ct_params = jax.tree_util.tree_map(
            lambda g, p: cotangent_like(g, p, axis), ct_params, inputs.params
        )
    return _Inputs(ct_params, ct_xs, ct_h0)


def adjoint_starts(solver, problem, pull, starts, xs_chunks, ct_chunks) -> Array:
    """`mu` with `mu[k] = c[k] + J_k^T mu[k+1]` (`mu[K] = 0`), where
    `pull(m)[k] = c[k] + J_k^T m[k]`, `c[k] = (d hs_k / d s_k)^T ct_chunks[k]`.

    How depends on the Jacobians the solver's forward pass used
    (`solver._linearise`): dense chunk Jacobians give the exact reverse-time linear
    recurrence at once; diagonal ones precondition an iteration; none (Picard) iterate
    `mu <- pull(shift(mu))`. The iterations use only `pull` (no Jacobian matrix),
    stop at the solver's tolerances and fall back to an exact sweep over the chunks
    when they do not converge in `max_iters`.
    """
    axis = solver.axis_name
    shift = lambda m: shift_backward(m, axis)
    end = lambda s, xs_k: chunk_end(problem, s, xs_k)
    jac = solver._linearise(end, starts, xs_chunks, transposed=True)
    if jac is not None and axis is None:  # the last chunk's J multiplies mu[K] = 0
        jac = jac.at[-1].set(0)
    # m[k] = r[k] + jac[k] m[k+1], m[K] = 0
    solve = lambda r: linear_recurrence(jac, r, reverse=True, axis_name=axis)
    if jac is not None and jac.ndim == 3:  # dense: the exact recurrence at once
        return solve(pull(jnp.zeros_like(starts)))
    if jac is None:
        sweep = lambda mu: pull(shift(mu))
    else:  # quasi-Newton: the diagonal part solved exactly, the rest iterated
        sweep = lambda mu: mu + solve(pull(shift(mu)) - mu)
    mu, converged = _iterate_adjoint(solver, sweep, starts)
    return lax.cond(
        converged,
        lambda: mu,
        lambda: _exact_sweep(solver, problem, starts, xs_chunks, ct_chunks),
    )


def _iterate_adjoint(solver, sweep, starts):
    """`sweep` from `mu = 0` until it changes `mu` by at most `atol * max|mu| +
    rtol * |mu|` (cotangents have no scale of their own): `(mu, converged)`."""
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
