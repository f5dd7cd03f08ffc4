"""Shared machinery of the solvers: the flattened problem, chunked runs, and the
parallel-in-time iteration with its implicit gradient.

Every solver sees the recurrence as `h[t] = f(x[t], h[t-1])` on a flat state vector of
size `d` (pytree states are raveled). The parallel solvers split time into K chunks of C
steps; their unknowns are the chunk-start states `s[k]` (`s[0] = h0`), which satisfy
`s[k+1] = F_k(s[k])`, where `F_k` runs the cell exactly and sequentially over chunk k.
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._chunking import from_chunks, shift_in, to_chunks
from .._linear import linear_recurrence
from .._solution import RESULTS


class Problem(eqx.Module):
    """`h[t] = step(params, z[t], h[t-1])` on flat states, `h[-1] = h0`, where
    `z[t] = project(params, x[t])` (the identity when `project` is None).

    `project` is the part of a cell that does not depend on the state: every run over a
    block of steps applies it to the whole block at once (one matrix product instead of
    one per step), and its derivative is taken there too.
    """

    step: Callable = eqx.field(static=True)
    params: PyTree
    xs: PyTree[Array]
    h0: Array
    project: Callable | None = eqx.field(static=True, default=None)

    @property
    def length(self) -> int:
        return jax.tree_util.tree_leaves(self.xs)[0].shape[0]

    def scan(self, h0, xs, emit=True, params=None, unroll=1):
        """The sequential recurrence over `xs` from `h0`: `(hs or None, h_final)`."""
        params = self.params if params is None else params
        if self.project is not None:
            xs = jax.vmap(lambda x: self.project(params, x))(xs)

        def body(h, z):
            h = self.step(params, z, h)
            return h, (h if emit else None)

        h_final, hs = lax.scan(body, h0, xs, unroll=unroll)
        return hs, h_final


class AbstractSolver(eqx.Module):
    """Base class of the solvers passed to `pscan.recurrence`: `Sequential`, `Picard`
    and `Newton`. A new solver implements `solve`."""

    @abc.abstractmethod
    def solve(self, problem: Problem) -> tuple[Array, RESULTS, dict[str, Any]]:
        """Solves one recurrence (called by `pscan.recurrence`, which flattens the
        states).

        **Arguments:**

        - `problem`: the step function, its parameters, the inputs and the flat
            initial state.

        **Returns:**

        `(hs, result, stats)`: the flat states `(T, d)`, a `pscan.RESULTS` code and the
        statistics that `pscan.Solution.stats` documents.
        """


def _check_positive_int(owner, name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


def _check_tolerance(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{owner}: `{name}` must be a non-negative number, got {value!r}")


class AbstractShootingSolver(AbstractSolver):
    """Iterates on the chunk-start states; exact sequential runs inside chunks.

    Subclasses give `_update`: the new chunk starts from the current ones. The
    gradient is implicit: at the solution the backward pass solves the transposed
    boundary recurrence `mu[k] = c[k] + J_k^T mu[k+1]` with `pscan.linear_recurrence`
    and takes vectorised per-chunk VJPs; it never differentiates through iterations.
    """

    chunk_size: eqx.AbstractVar[int]
    max_iters: eqx.AbstractVar[int]
    rtol: eqx.AbstractVar[float]
    atol: eqx.AbstractVar[float]
    fallback: eqx.AbstractVar[str | None]
    axis_name: eqx.AbstractVar[str | None]
    name: ClassVar[str] = "solver"

    def __check_init__(self):
        _check_positive_int(self.name, "chunk_size", self.chunk_size)
        _check_positive_int(self.name, "max_iters", self.max_iters)
        _check_tolerance(self.name, "rtol", self.rtol)
        _check_tolerance(self.name, "atol", self.atol)
        if self.fallback not in (None, "sequential"):
            raise ValueError(
                f"{self.name}: `fallback` must be None or 'sequential', got "
                f"{self.fallback!r}"
            )
        if self.axis_name is not None and self.fallback is not None:
            raise ValueError(
                f"{self.name}: `fallback='sequential'` cannot be combined with "
                "`axis_name` (the exact fallback has no parallelism across devices)"
            )

    @abc.abstractmethod
    def _update(self, chunk_end, starts, xs, h0) -> Array:
        """New chunk starts `(K, d)` (the first is `h0`) from the current ones."""

    def solve(self, problem):
        if self.axis_name is not None and problem.length % self.chunk_size:
            raise ValueError(
                f"{self.name}: with `axis_name`, each device's block of steps must be a "
                f"multiple of `chunk_size` ({self.chunk_size}), got {problem.length} "
                "steps (pscan.sharded_recurrence pads for you)"
            )
        params, static_params = eqx.partition(problem.params, eqx.is_inexact_array)
        vjp_arg = (params, problem.xs, problem.h0)
        static = (problem.step, problem.project, static_params)
        return _shooting_solve(vjp_arg, static, self)


# --------------------------------------------------------------------------------------
# chunked runs
# --------------------------------------------------------------------------------------


def chunk_xs(problem: Problem, chunk_size: int):
    """`xs` as `(K, C, ...)`; the tail is padded with the last input (padded steps come
    after every real one, so they never affect a real state)."""
    last = jax.tree_util.tree_map(lambda x: x[-1], problem.xs)
    return to_chunks(problem.xs, chunk_size, fill=last)


def chunk_end(problem, s, xs_k):
    """`F_k(s)`: the state after running one chunk from `s`."""
    return problem.scan(s, xs_k, emit=False)[1]


def run_chunks(problem, starts, xs_chunks):
    """All chunks from their starts, in parallel: states `(T, d)`."""
    hs, _ = jax.vmap(problem.scan, in_axes=(0, 0))(starts, xs_chunks)
    return from_chunks(hs, problem.length)


def shift_forward(ends, h0, axis_name):
    """The chunk starts that chunk ends imply: `[h0, ends[0], ..., ends[K-2]]`; with
    `axis_name`, a device's first start is the previous device's last end."""
    if axis_name is None:
        return shift_in(ends, h0)
    last = lax.all_gather(ends[-1], axis_name)
    i = lax.axis_index(axis_name)
    incoming = jnp.where(i == 0, h0, last[jnp.maximum(i - 1, 0)])
    return jnp.concatenate([incoming[None], ends[:-1]])


def shift_backward(mu, axis_name):
    """`mu[k + 1]` for every chunk `k` (zero after the last one); with `axis_name`, a
    device's last chunk reads the next device's first."""
    if axis_name is None:
        return jnp.concatenate([mu[1:], jnp.zeros_like(mu[:1])])
    first = lax.all_gather(mu[0], axis_name)
    devices = first.shape[0]
    i = lax.axis_index(axis_name)
    incoming = jnp.where(i == devices - 1, 0, first[jnp.minimum(i + 1, devices - 1)])
    return jnp.concatenate([mu[1:], incoming[None]])


def _varying(x, axis_name):
    """`x`, typed as varying across `axis_name` (for `shard_map`'s checks on jax
    versions that track it; a no-op elsewhere)."""
    if axis_name is None:
        return x
    pcast = getattr(lax, "pcast", None)
    if pcast is not None:
        return pcast(x, (axis_name,), to="varying")
    pvary = getattr(lax, "pvary", None)
    return x if pvary is None else pvary(x, (axis_name,))


def _varies(x, axis_name) -> bool:
    """Whether `x` is typed as varying across `axis_name` (only when `shard_map` tracks
    it: `jax.shard_map` with `check_vma=True`)."""
    typeof = getattr(jax, "typeof", None) or jax.core.get_aval  # jax < 0.6
    aval = typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; `vma` before
    varying = manual.varying if manual is not None else getattr(aval, "vma", ())
    return axis_name in varying


def _cotangent_like(ct, primal, axis_name):
    """The cotangent of a replicated input: summed over the devices here when
    `shard_map` tracks variance (its transpose sums it otherwise)."""
    if axis_name is not None and _varies(ct, axis_name) and not _varies(primal, axis_name):
        return lax.psum(ct, axis_name)
    return ct


def _everywhere(x, axis_name, reduce):
    """`x` reduced over the devices of `axis_name` (unchanged without one)."""
    return x if axis_name is None else reduce(x, axis_name)


def _scaled_change(new, old, rtol, atol):
    """`max |new - old| / (atol + rtol |new|)`: converged when `<= 1`."""
    scale = atol + rtol * jnp.abs(new)
    return jnp.max(jnp.abs(new - old) / scale, initial=0.0)


def _iterate(solver, problem, xs_chunks):
    """The solver's sweeps in a `while_loop`. Returns `(starts, iters, change, finite)`."""
    k = jax.tree_util.tree_leaves(xs_chunks)[0].shape[0]
    axis = solver.axis_name
    starts = _varying(jnp.broadcast_to(problem.h0, (k, problem.h0.shape[0])), axis)
    end = lambda s, xs_k: chunk_end(problem, s, xs_k)

    def _all_finite(x):
        finite = jnp.all(jnp.isfinite(x)).astype(jnp.int32)
        return _everywhere(finite, axis, lax.pmin) > 0

    def cond(carry):
        _, it, change, finite = carry
        return (it < solver.max_iters) & (change > 1) & finite

    def body(carry):
        starts, it, _, _ = carry
        new = solver._update(end, starts, xs_chunks, problem.h0)
        finite = _all_finite(new)
        # a non-finite linearised step falls back to a Picard sweep from the last
        # finite guess, which always makes progress (one more chunk becomes exact);
        # `finite` is the same on every device, so they all take the same branch
        new = lax.cond(
            finite,
            lambda: new,
            lambda: shift_forward(
                jax.vmap(end)(starts, xs_chunks), problem.h0, axis
            ),
        )
        finite = _all_finite(new)
        new = jnp.where(finite, new, starts)
        change = _scaled_change(new, starts, solver.rtol, solver.atol)
        change = _everywhere(change, axis, lax.pmax)
        return new, it + 1, change, finite

    inf = jnp.array(jnp.inf, problem.h0.real.dtype)
    init = (starts, jnp.array(0), inf, jnp.array(True))
    return lax.while_loop(cond, body, init)


# --------------------------------------------------------------------------------------
# the solve and its implicit gradient
# --------------------------------------------------------------------------------------


def _problem(vjp_arg, static) -> Problem:
    params, xs, h0 = vjp_arg
    step, project, static_params = static
    return Problem(step, eqx.combine(params, static_params), xs, h0, project)


@eqx.filter_custom_vjp
def _shooting_solve(vjp_arg, static, solver):
    hs, result, stats, _ = _shooting_forward(vjp_arg, static, solver)
    return hs, result, stats


def _shooting_forward(vjp_arg, static, solver):
    problem = _problem(vjp_arg, static)
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
    hs = run_chunks(problem, starts, xs_chunks)
    stats = {"num_iterations": iters, "max_residual": change, "fell_back": fell_back}
    return hs, result, stats, starts


@_shooting_solve.def_fwd
def _shooting_solve_fwd(perturbed, vjp_arg, static, solver):
    del perturbed
    hs, result, stats, starts = _shooting_forward(vjp_arg, static, solver)
    return (hs, result, stats), starts


@_shooting_solve.def_bwd
def _shooting_solve_bwd(starts, grad_obj, perturbed, vjp_arg, static, solver):
    del perturbed
    ct_hs = grad_obj[0]
    problem = _problem(vjp_arg, static)
    params = vjp_arg[0]
    c = solver.chunk_size
    xs_chunks = chunk_xs(problem, c)
    k = starts.shape[0]
    if ct_hs is None:
        ct_hs = jnp.zeros((problem.length, *problem.h0.shape), problem.h0.dtype)
    ct_chunks = jnp.pad(ct_hs, ((0, k * c - problem.length), (0, 0))).reshape(k, c, -1)

    def chunk(params, s, xs_k):
        return problem.scan(s, xs_k, params=eqx.combine(params, static[-1]))

    # c[k] = (d hs_k / d s_k)^T ct_k
    def local(s, xs_k, ct_k):
        _, vjp = jax.vjp(lambda s: chunk(params, s, xs_k)[0], s)
        return vjp(ct_k)[0]

    c_k = jax.vmap(local)(starts, xs_chunks, ct_chunks)
    axis = solver.axis_name
    # the chunk Jacobians J_k = d F_k / d s_k by forward mode, all chunks at once (the
    # last chunk's is not needed; across devices, only the last device's)
    jacobian = jax.vmap(jax.jacfwd(lambda s, xs_k: chunk(params, s, xs_k)[1]))
    if axis is None:
        head = jax.tree_util.tree_map(lambda x: x[:-1], xs_chunks)
        jac = jacobian(starts[:-1], head)
        d = problem.h0.shape[0]
        jac = jnp.concatenate([jac, jnp.zeros((1, d, d), jac.dtype)])
    else:
        jac = jacobian(starts, xs_chunks)
    # mu[k] = c[k] + J_k^T mu[k+1]: a reverse-time dense linear recurrence over chunks
    mu = linear_recurrence(
        jnp.swapaxes(jac, -1, -2), c_k, reverse=True, axis_name=axis
    )
    # cotangents of params and xs: one vectorised VJP per chunk, the cotangent of each
    # chunk's end being the next chunk's mu
    mu_next = shift_backward(mu, axis)

    def grads(s, xs_k, ct_k, mu_k):
        _, vjp = jax.vjp(lambda p, xs_k: chunk(p, s, xs_k), params, xs_k)
        return vjp((ct_k, mu_k))

    ct_params, ct_xs = jax.vmap(grads)(starts, xs_chunks, ct_chunks, mu_next)
    ct_params = jax.tree_util.tree_map(lambda g: jnp.sum(g, axis=0), ct_params)
    ct_xs = from_chunks(ct_xs, problem.length)
    ct_h0 = mu[0]
    if axis is not None:  # h0 enters on the first device only
        ct_h0 = jnp.where(lax.axis_index(axis) == 0, ct_h0, 0)
        ct_h0 = _cotangent_like(ct_h0, vjp_arg[2], axis)
        ct_params = jax.tree_util.tree_map(
            lambda g, p: _cotangent_like(g, p, axis), ct_params, params
        )
    return ct_params, ct_xs, ct_h0
