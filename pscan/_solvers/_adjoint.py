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

from .._axis import cotangent_like, shift_backward
from .._chunking import from_chunks
from .._linear import linear_recurrence
from .._solution import RESULTS
from ._base import Problem, chunk_xs
from ._iterate import run_chunks, shooting_forward


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
    axis = solver.axis_name
    c = solver.chunk_size
    xs_chunks = chunk_xs(problem, c)
    k = starts.shape[0]
    if ct_hs is None:
        ct_hs = jnp.zeros((problem.length, *problem.h0.shape), problem.h0.dtype)
    ct_chunks = jnp.pad(ct_hs, ((0, k * c - problem.length), (0, 0))).reshape(k, c, -1)

    def chunk(params, s, xs_k):
        return _problem(inputs, static, params).scan(s, xs_k)

    # c[k] = (d hs_k / d s_k)^T ct_k
    def local(s, xs_k, ct_k):
        _, vjp = jax.vjp(lambda s: chunk(inputs.params, s, xs_k)[0], s)
        return vjp(ct_k)[0]

    c_k = jax.vmap(local)(starts, xs_chunks, ct_chunks)
    # the chunk Jacobians J_k by forward mode, all chunks at once (the last chunk's is
    # not needed; across devices, only the last device's)
    end = lambda s, xs_k: chunk(inputs.params, s, xs_k)[1]
    jacobian = jax.vmap(jax.jacfwd(end))
    if axis is None:
        head = jax.tree_util.tree_map(lambda x: x[:-1], xs_chunks)
        jac = jacobian(starts[:-1], head)
        d = problem.h0.shape[0]
        jac = jnp.concatenate([jac, jnp.zeros((1, d, d), jac.dtype)])
    else:
        jac = jacobian(starts, xs_chunks)
    # mu[k] = c[k] + J_k^T mu[k+1]: a reverse-time dense linear recurrence over chunks
    mu = linear_recurrence(jnp.swapaxes(jac, -1, -2), c_k, reverse=True, axis_name=axis)
    # cotangents of params and xs: one vectorised VJP per chunk, the cotangent of each
    # chunk's end being the next chunk's mu
    mu_next = shift_backward(mu, axis)

    def grads(s, xs_k, ct_k, mu_k):
        _, vjp = jax.vjp(lambda p, xs_k: chunk(p, s, xs_k), inputs.params, xs_k)
        return vjp((ct_k, mu_k))

    ct_params, ct_xs = jax.vmap(grads)(starts, xs_chunks, ct_chunks, mu_next)
    ct_params = jax.tree_util.tree_map(lambda g: jnp.sum(g, axis=0), ct_params)
    ct_xs = from_chunks(ct_xs, problem.length)
    ct_h0 = mu[0]
    if axis is not None:  # h0 enters on the first device only
        ct_h0 = jnp.where(lax.axis_index(axis) == 0, ct_h0, 0)
        ct_h0 = cotangent_like(ct_h0, inputs.h0, axis)
        ct_params = jax.tree_util.tree_map(
            lambda g, p: cotangent_like(g, p, axis), ct_params, inputs.params
        )
    return _Inputs(ct_params, ct_xs, ct_h0)
