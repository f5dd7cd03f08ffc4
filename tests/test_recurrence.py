import dataclasses
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pscan

from .helpers import (
    ElmanCell,
    assert_allclose,
    assert_exact_derivatives,
    compiles,
    dot_precisions,
    scan_cell,
    to_dtype,
)

TIGHT = dict(rtol=1e-13, atol=1e-13)
solve = eqx.filter_jit(pscan.recurrence)
SOLVERS = {
    "sequential": pscan.Sequential(),
    "checkpointed": pscan.Sequential(checkpoint=6),
    "picard": pscan.Picard(chunk_size=8, **TIGHT),
    "deer": pscan.Newton(**TIGHT),
    "quasi-deer": pscan.Newton(jacobian="diagonal", **TIGHT),
    "shooting": pscan.Newton(chunk_size=8, **TIGHT),
    "quasi-shooting": pscan.Newton(chunk_size=5, jacobian="diagonal", **TIGHT),
    "damped": pscan.Newton(chunk_size=4, damping=0.3, **TIGHT),
    "elk": pscan.ELK(**TIGHT),
    "quasi-elk-chunked": pscan.ELK(chunk_size=4, jacobian="diagonal", **TIGHT),
}
LENGTH = 37  # a prime: no chunk size divides it


def make_cell(name, dtype=jnp.float64, n_in=2, n_hidden=4):
    key = jax.random.PRNGKey(0)
    if name == "elman":
        return ElmanCell(n_in, n_hidden, key=key, dtype=dtype), jnp.zeros(
            n_hidden, dtype
        )
    if name == "gru":
        cell = to_dtype(eqx.nn.GRUCell(n_in, n_hidden, key=key), dtype)
        return cell, jnp.full(n_hidden, 0.1, dtype)
    if name == "lstm":
        cell = to_dtype(eqx.nn.LSTMCell(n_in, n_hidden, key=key), dtype)
        return cell, (jnp.full(n_hidden, 0.1, dtype), jnp.zeros(n_hidden, dtype))
    raise ValueError(name)


def make_xs(length, n_in=2, dtype=jnp.float64, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (length, n_in), dtype)


@pytest.mark.parametrize("cell_name", ["elman", "gru", "lstm"])
@pytest.mark.parametrize("solver", SOLVERS.values(), ids=SOLVERS.keys())
def test_matches_sequential(solver, cell_name):
    cell, h0 = make_cell(cell_name)
    xs = make_xs(LENGTH)
    sol = solve(cell, xs, h0, solver=solver)
    assert sol.result == pscan.RESULTS.successful
    ref = scan_cell(cell, xs, h0)
    for x, y in zip(jax.tree_util.tree_leaves(sol.hs), jax.tree_util.tree_leaves(ref)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-10)
    own = {"radius"} if isinstance(solver, pscan.ELK) else set()
    assert set(sol.stats) == {
        "num_iterations",
        "max_residual",
        "fell_back",
        "num_at_bound",
        *own,
    }


@pytest.mark.parametrize("solver", SOLVERS.values(), ids=SOLVERS.keys())
def test_float32(solver):
    cell, h0 = make_cell("gru", jnp.float32, n_hidden=8)
    xs = make_xs(200, dtype=jnp.float32)
    if isinstance(solver, pscan.AbstractShootingSolver):
        solver = dataclasses.replace(solver, rtol=1e-6, atol=1e-6)
    sol = solve(cell, xs, h0, solver=solver)
    assert sol.hs.dtype == jnp.float32
    np.testing.assert_allclose(sol.hs, scan_cell(cell, xs, h0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [1, 2, 8, 9])
@pytest.mark.parametrize("solver", ["picard", "shooting", "deer", "elk"])
def test_short_sequences(solver, length):
    cell, h0 = make_cell("elman")
    xs = make_xs(length)
    sol = solve(cell, xs, h0, solver=SOLVERS[solver])
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))


@pytest.mark.parametrize(
    "solver", ["picard", "shooting", "quasi-deer", "elk", "quasi-elk-chunked"]
)
def test_vmap_over_batch(solver):
    cell, h0 = make_cell("gru")
    xs = jnp.stack([make_xs(LENGTH, seed=s) for s in range(3)])
    h0s = jnp.stack([h0, -h0, 2 * h0])
    run = lambda xs, h0: pscan.recurrence(cell, xs, h0, solver=SOLVERS[solver]).hs
    out = jax.jit(jax.vmap(run))(xs, h0s)
    for i in range(3):
        assert_allclose(out[i], scan_cell(cell, xs[i], h0s[i]))


def _loss(cell, xs, h0, solver):
    hs = pscan.recurrence(cell, xs, h0, solver=solver).hs
    return sum(
        jnp.sum(jnp.sin(h) * (1 + jnp.arange(h.shape[0])[:, None] / 10))
        for h in jax.tree_util.tree_leaves(hs)
    )


def _scan_loss(cell, xs, h0):
    hs = scan_cell(cell, xs, h0)
    return sum(
        jnp.sum(jnp.sin(h) * (1 + jnp.arange(h.shape[0])[:, None] / 10))
        for h in jax.tree_util.tree_leaves(hs)
    )


@pytest.mark.parametrize("cell_name", ["elman", "lstm"])
@pytest.mark.parametrize("solver", SOLVERS.values(), ids=SOLVERS.keys())
def test_gradients_match_scan_autodiff(solver, cell_name):
    """With respect to the cell's parameters, `xs` and `h0`, against `lax.scan`."""
    cell, h0 = make_cell(cell_name)
    xs = make_xs(LENGTH)
    grad = eqx.filter_jit(eqx.filter_grad(lambda args: _loss(*args, solver)))
    g = grad((cell, xs, h0))
    g_ref = eqx.filter_grad(lambda args: _scan_loss(*args))((cell, xs, h0))
    leaves, ref_leaves = jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)
    assert len(leaves) == len(ref_leaves)
    for x, y in zip(leaves, ref_leaves):
        np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-10)


def test_deer_as_traced_for_a_tpu(monkeypatch, traced_as):
    """DEER on a TPU builds its Jacobians' column groups stacked (`_stacked`), not in
    place: traced here as if the backend were one, with 20 state entries (two groups
    of 16, the second overlapping), the states and the gradient are those of the
    default path bit for bit, and the sequential answer."""
    from pscan._solvers import _jacobian

    cell, h0 = make_cell("gru", n_hidden=20)
    xs = make_xs(LENGTH)
    solver = SOLVERS["deer"]
    run = lambda: (
        pscan.recurrence(cell, xs, h0, solver=solver),
        eqx.filter_grad(lambda args: _loss(*args, solver))((cell, xs, h0)),
    )
    here = run()
    traced = []
    stack = _jacobian._stacked
    spy = lambda *a: traced.append(a[1].shape) or stack(*a)
    monkeypatch.setattr(_jacobian, "_stacked", spy)
    traced_as("tpu")
    there = run()
    assert traced  # the forward's Jacobians and the gradient's transposes
    assert there[0].result == pscan.RESULTS.successful
    assert_allclose(there[0].hs, scan_cell(cell, xs, h0))
    same = jax.tree_util.tree_map(jnp.array_equal, here, there)
    assert all(jax.tree_util.tree_leaves(same))


@pytest.mark.parametrize(
    "solver", ["picard", "shooting", "quasi-shooting", "quasi-elk-chunked"]
)
def test_check_grads(solver):
    """Forward and reverse mode against finite differences."""
    cell, h0 = make_cell("elman", n_hidden=2)
    xs = make_xs(7)
    f = lambda xs, h0, w: (
        pscan.recurrence(
            eqx.tree_at(lambda c: c.u, cell, w), xs, h0, solver=SOLVERS[solver]
        ).hs
    )
    check_grads(jax.jit(f), (xs, h0, cell.u), order=1, modes=["fwd", "rev"])


@pytest.mark.parametrize("solver", ["picard", "shooting", "elk"])
def test_second_order_refused(solver):
    """Second derivatives through the implicit rules would miss terms: refused, also
    where the first derivative is a compiled call's (`jax.hessian(jax.jit(f))` gave
    zeros), with respect to `h0` or the cell's parameters, forward over reverse."""
    cell, h0 = make_cell("elman", n_hidden=2)
    xs = make_xs(5)
    f = lambda c, h0: jnp.sum(
        pscan.recurrence(c, xs, h0, solver=SOLVERS[solver]).hs ** 2
    )
    wrt_h0 = lambda h0: f(cell, h0)
    wrt_u = lambda u: f(eqx.tree_at(lambda c: c.u, cell, u), h0)
    for second in (
        lambda: jax.hessian(wrt_h0)(h0),
        lambda: jax.hessian(jax.jit(wrt_h0))(h0),
        lambda: jax.hessian(eqx.filter_jit(wrt_u))(cell.u),
        lambda: jax.jvp(jax.jit(jax.grad(wrt_h0)), (h0,), (h0,)),
    ):
        with pytest.raises(NotImplementedError, match="second order.*ELK"):
            second()


SHOOTING = [k for k in SOLVERS if k not in ("sequential", "checkpointed")]


@pytest.mark.parametrize("solver", [SOLVERS[k] for k in SHOOTING], ids=SHOOTING)
def test_forward_mode_matches_scan(solver):
    """`jax.jvp` with respect to the cell, `xs` and `h0` together, and `jax.jacfwd`
    (a vmapped JVP), against forward mode through `lax.scan`."""
    cell, h0 = make_cell("elman")
    xs = make_xs(LENGTH)
    tangents = (
        jax.tree_util.tree_map(jnp.cos, cell),
        jnp.sin(xs),
        jnp.ones_like(h0),
    )
    f = lambda c, xs, h0: pscan.recurrence(c, xs, h0, solver=solver).hs
    jvp = eqx.filter_jit(lambda p, t: jax.jvp(f, p, t))
    hs, t = jvp((cell, xs, h0), tangents)
    hs_ref, t_ref = jax.jvp(scan_cell, (cell, xs, h0), tangents)
    assert_allclose(hs, hs_ref)
    assert_allclose(t, t_ref)
    jac = jax.jit(jax.jacfwd(lambda h0: f(cell, xs, h0)))(h0)
    assert_allclose(jac, jax.jacfwd(lambda h0: scan_cell(cell, xs, h0))(h0))


def test_vmap_of_grad():
    cell, h0 = make_cell("elman")
    xs = jnp.stack([make_xs(LENGTH, seed=s) for s in range(2)])
    per_example = lambda xs, c: _loss(c, xs, h0, SOLVERS["shooting"])
    per_grad = eqx.filter_grad(lambda c, xs: per_example(xs, c))
    g = eqx.filter_jit(lambda c, xs: jax.vmap(per_grad, in_axes=(None, 0))(c, xs))(
        cell, xs
    )
    for i in range(2):
        g_ref = eqx.filter_grad(lambda c: _scan_loss(c, xs[i], h0))(cell)
        assert_allclose(g.u[i], g_ref.u)


def _gradient_temp_bytes(cell, xs, h0, solver):
    """XLA temp of the compiled gradient of `sum(hs)` with respect to the cell."""
    f = eqx.filter_grad(
        lambda c: jnp.sum(pscan.recurrence(c, xs, h0, solver=solver).hs)
    )
    compiled = jax.jit(lambda c: f(c)).lower(cell).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_checkpointed_gradient_memory():
    """`Sequential(checkpoint=C)` keeps fewer residuals than plain autodiff of a scan."""
    cell, h0 = make_cell("elman", jnp.float32, n_in=8, n_hidden=16)
    xs = make_xs(4096, n_in=8, dtype=jnp.float32)
    temp_bytes = lambda solver: _gradient_temp_bytes(cell, xs, h0, solver)
    assert temp_bytes(pscan.Sequential(checkpoint=64)) < 0.75 * temp_bytes(
        pscan.Sequential()
    )


@pytest.mark.parametrize("make", [pscan.Picard, pscan.Newton, pscan.ELK])
@pytest.mark.parametrize("length", [4096, 4000])
def test_gradient_memory_is_below_autodiff_through_a_scan(make, length):
    """The implicit gradient of the chunked solvers holds less than autodiff through
    `lax.scan` (XLA temp, GRU 1 -> 32, float32, a multiple of the chunk size and not):
    the chunk runs are pulled back step by step from their states, each step
    recomputed, not from every step's residuals (they held 1.01-1.25x `lax.scan`'s,
    now 0.25-0.6x); the derivatives' own fallbacks (a `lax.cond` branch) must not hold
    `T x d` buffers of their own (a sweep over every step at once took 1.34x)."""
    cell = eqx.nn.GRUCell(1, 32, key=jax.random.PRNGKey(0))
    h0 = jnp.zeros(32)
    xs = make_xs(length, n_in=1, dtype=jnp.float32)
    temp_bytes = lambda solver: _gradient_temp_bytes(cell, xs, h0, solver)
    base = temp_bytes(pscan.Sequential())
    assert temp_bytes(make(chunk_size=64)) <= 0.65 * base


@pytest.mark.parametrize("length, bound", [(4096, 0.19), (4000, 0.3)])
def test_gradient_reads_the_states_in_place(length, bound):
    """The pull back from the states reads the state before each step where the
    forward wrote it (the chunk's start for a chunk's first step), in the chunks'
    layout the forward kept: no copy of the states shifted by one step, and for a
    length that is not a multiple of the chunk size no padded copy of them (GRU 1 ->
    32, chunks of 64: Picard's gradient holds 0.14x the XLA temp of autodiff through
    `lax.scan` at T = 4096, 0.25x at T = 4000; with those copies 0.25x and 0.36x; the
    same ratios with XLA's optimisations off, as in the tests)."""
    cell = eqx.nn.GRUCell(1, 32, key=jax.random.PRNGKey(0))
    xs = make_xs(length, n_in=1, dtype=jnp.float32)
    temp_bytes = lambda solver: _gradient_temp_bytes(cell, xs, jnp.zeros(32), solver)
    picard = temp_bytes(pscan.Picard(chunk_size=64))
    assert picard < bound * temp_bytes(pscan.Sequential())


def test_quasi_deer_gradient_recomputes_its_steps():
    """Quasi-DEER's gradient (chunks of one step, an iterated backward) recomputes the
    steps in every product instead of keeping their residuals: below `lax.scan`'s
    temporaries (GRU 1 -> 32, T = 4096: 0.89x; it held 1.75x)."""
    cell = eqx.nn.GRUCell(1, 32, key=jax.random.PRNGKey(0))
    h0 = jnp.zeros(32)
    xs = make_xs(4096, n_in=1, dtype=jnp.float32)
    temp_bytes = lambda solver: _gradient_temp_bytes(cell, xs, h0, solver)
    quasi = pscan.Newton(jacobian="diagonal")
    assert temp_bytes(quasi) <= temp_bytes(pscan.Sequential())


def test_forward_reads_the_states_out_without_a_copy():
    """The chunk runs write their states where `(T, d)` reshapes to `(K, C, d)`: the
    forward's XLA temp holds no `T x d` array besides the output (a vectorised
    `lax.scan` writes `(C, K, d)`, a transposed copy: 550 kB here)."""
    cell = eqx.nn.GRUCell(1, 32, key=jax.random.PRNGKey(0))
    xs = make_xs(4096, n_in=1, dtype=jnp.float32)
    solver = pscan.Picard(chunk_size=64)
    f = lambda c: pscan.recurrence(c, xs, jnp.zeros(32), solver=solver).hs
    compiled = jax.jit(f).lower(cell).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 4096 * 32 * 4 / 4


# ---------------------------------------------------------------------------------------
# Difficult cells: converge and match, are flagged, or fall back -- never silently wrong
# ---------------------------------------------------------------------------------------


def _chaotic():
    cell, h0 = make_cell("gru", n_hidden=6)
    return jax.tree_util.tree_map(
        lambda x: 100 * x if eqx.is_inexact_array(x) else x, cell
    ), h0


@pytest.mark.parametrize(
    "solver",
    [
        pscan.Newton(max_iters=3, rtol=1e-12, atol=1e-12),
        pscan.Newton(jacobian="diagonal", max_iters=5, rtol=1e-12, atol=1e-12),
        pscan.Picard(chunk_size=4, max_iters=3, rtol=1e-12, atol=1e-12),
        pscan.Newton(chunk_size=4, damping=0.5, max_iters=4, rtol=1e-12, atol=1e-12),
    ],
)
def test_difficult_cell_never_silently_wrong(solver):
    cell, h0 = _chaotic()
    xs = make_xs(60, n_in=2)
    ref = scan_cell(cell, xs, h0)
    sol = solve(cell, xs, h0, solver=solver, throw=False)
    converged = sol.result == pscan.RESULTS.successful
    if converged:
        assert_allclose(sol.hs, ref)
    else:
        assert sol.stats["max_residual"] > 1
    # the fallback always gives the exact answer, and says so
    fb = dataclasses.replace(solver, fallback="sequential")
    sol = solve(cell, xs, h0, solver=fb)
    assert sol.result == pscan.RESULTS.successful
    assert bool(sol.stats["fell_back"]) == (not converged)
    assert_allclose(sol.hs, ref)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: pscan.Newton(chunk_size=4, **kw),
        lambda **kw: pscan.Newton(chunk_size=4, jacobian="diagonal", **kw),
        lambda **kw: pscan.Picard(chunk_size=4, **kw),
    ],
    ids=["dense", "diagonal", "picard"],
)
def test_fallback_gradient_is_exact(make):
    """The forward pass falls back; the gradient's own iteration (diagonal, Picard)
    does not converge in 2 iterations either and falls back to its exact sweep. (A
    length that is not a multiple of the chunk size: the fallback's states padded.)"""
    cell, h0 = _chaotic()
    xs = make_xs(61)
    fb = make(max_iters=2, fallback="sequential")
    g = eqx.filter_jit(eqx.filter_grad(lambda c: _loss(c, xs, h0, fb)))(cell)
    g_ref = eqx.filter_grad(lambda c: _scan_loss(c, xs, h0))(cell)
    np.testing.assert_allclose(g.weight_hh, g_ref.weight_hh, rtol=1e-7, atol=1e-7)
    # and the tangent's iteration falls back to its exact sweep the same way
    t_xs = jnp.cos(jnp.arange(xs.size, dtype=xs.dtype)).reshape(xs.shape)
    tangents = (t_xs, jnp.ones_like(h0))
    hs = lambda x, h: pscan.recurrence(cell, x, h, solver=fb).hs
    t = jax.jit(lambda: jax.jvp(hs, (xs, h0), tangents)[1])()
    t_ref = jax.jvp(lambda x, h: scan_cell(cell, x, h), (xs, h0), tangents)[1]
    np.testing.assert_allclose(t, t_ref, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: pscan.Newton(chunk_size=4, jacobian="diagonal", **kw),
        lambda **kw: pscan.Picard(chunk_size=4, **kw),
    ],
    ids=["diagonal", "picard"],
)
def test_derivative_iterations_go_on_to_the_exact_answer(make):
    """Without a fallback, the derivatives' own boundary iterations (Picard's, the
    diagonal preconditioner's) go on past `max_iters` until they converge, exact
    after K iterations (iteration n makes n chunks exact): a warm start at the answer
    converges in one iteration, the derivatives on a chaotic cell cannot."""
    cell, h0 = _chaotic()
    xs = make_xs(60)
    solver = make(max_iters=1, rtol=1e-12, atol=1e-12)
    guess = scan_cell(cell, xs, h0)
    assert_exact_derivatives(solver, cell, xs, h0, guess=guess)


@pytest.mark.parametrize("make", [pscan.Newton, pscan.ELK])
def test_not_converged_raises(make):
    cell, h0 = _chaotic()
    xs = make_xs(60)
    solver = make(max_iters=2, rtol=1e-12, atol=1e-12)
    sol = pscan.recurrence(cell, xs, h0, solver=solver, throw=False)
    assert sol.result == pscan.RESULTS.max_iters_reached
    assert int(sol.stats["num_iterations"]) == 2
    assert float(sol.stats["max_residual"]) > 1
    with pytest.raises(Exception, match="did not converge within `max_iters`"):
        jax.block_until_ready(pscan.recurrence(cell, xs, h0, solver=solver).hs)
    # compiled, in a gradient, and with resets (the checks are the solver's own)
    loss = lambda c, **kw: jnp.sum(pscan.recurrence(c, xs, h0, solver=solver, **kw).hs)
    with pytest.raises(Exception, match="did not converge within `max_iters`"):
        jax.block_until_ready(eqx.filter_jit(eqx.filter_grad(loss))(cell))
    with pytest.raises(Exception, match="did not converge within `max_iters`"):
        jax.block_until_ready(loss(cell, resets=jnp.arange(60) % 30 == 0))


@pytest.mark.parametrize("solver", ["picard", "shooting"])
def test_throw_costs_no_memory(solver):
    """The default `throw=True` checks the chunk starts, not the states: the forward
    and the gradient (of a loss that needs the states in its backward pass, and of
    one that does not) hold the buffers of `throw=False` (states of `(T, d)`: the
    check on them held a copy)."""
    cell, h0 = make_cell("gru")
    xs = make_xs(512)

    def temp(throw, power):
        hs = lambda c: (
            pscan.recurrence(c, xs, h0, solver=SOLVERS[solver], throw=throw).hs
        )
        programs = (hs, eqx.filter_grad(lambda c: jnp.sum(hs(c) ** power)))
        return [
            jax.jit(lambda c, f=f: f(c)).lower(cell).compile().memory_analysis()
            for f in programs
        ]

    # at most a copy of the chunk starts (and a few scalars) more
    starts = -(-512 // SOLVERS[solver].chunk_size) * h0.size * h0.dtype.itemsize
    for power in (1, 2):
        for checked, unchecked in zip(temp(True, power), temp(False, power)):
            extra = checked.temp_size_in_bytes - unchecked.temp_size_in_bytes
            assert extra <= starts


def test_enough_iterations_are_exact():
    """ceil(T / chunk_size) sweeps reach the sequential answer even on a chaotic cell."""
    cell, h0 = _chaotic()
    xs = make_xs(40)
    for solver in (
        pscan.Picard(chunk_size=4, max_iters=10, rtol=0.0, atol=1e-12),
        pscan.Newton(chunk_size=4, max_iters=10, rtol=0.0, atol=1e-12),
    ):
        sol = pscan.recurrence(cell, xs, h0, solver=solver, throw=False)
        assert_allclose(sol.hs, scan_cell(cell, xs, h0))


def test_nonfinite_is_flagged():
    """A cell that blows up: the loop's inf / NaN states, flagged, never raised."""

    class Explode(eqx.Module):
        def __call__(self, x, h):
            return h * 1e200 + x

    xs = jnp.ones((20, 2))
    ref = scan_cell(Explode(), xs, jnp.ones(2))
    assert not np.all(np.isfinite(ref))
    for throw in (False, True):
        sol = pscan.recurrence(
            Explode(), xs, jnp.ones(2), solver=pscan.Newton(chunk_size=4), throw=throw
        )
        assert sol.result == pscan.RESULTS.nonfinite
        hs, ref_ = np.asarray(sol.hs), np.asarray(ref)
        # non-finite exactly where the loop is; equal up to the end of the chunk
        # where the loop first overflows (later chunks start from NaN, not inf)
        np.testing.assert_array_equal(np.isfinite(hs), np.isfinite(ref_))
        np.testing.assert_array_equal(hs[:4], ref_[:4])


@pytest.mark.parametrize("chunk_size", [3, 16, 24])
def test_diagonal_newton_chunk_sizes(chunk_size):
    """Quasi-Newton's diagonal Jacobians, whatever the chunk size picks for their
    groups (chunks in turn below 8 steps, several products at once from 16): values
    and gradients equal `lax.scan`'s."""
    cell, h0 = make_cell("gru")
    xs = make_xs(LENGTH)
    solver = pscan.Newton(chunk_size=chunk_size, jacobian="diagonal", **TIGHT)
    assert_allclose(solve(cell, xs, h0, solver=solver).hs, scan_cell(cell, xs, h0))
    loss = lambda run: lambda c: jnp.sum(jnp.sin(run(c, xs, h0)))
    ours = lambda c, xs, h0: pscan.recurrence(c, xs, h0, solver=solver).hs
    g = eqx.filter_jit(eqx.filter_grad(loss(ours)))(cell)
    g_ref = eqx.filter_grad(loss(scan_cell))(cell)
    assert_allclose(g.weight_hh, g_ref.weight_hh)


def test_iterates_beyond_the_bound_never_converge():
    """Iterates are held at +-sqrt(largest float) (runaway Newton steps): states that
    are truly beyond it (finite, float32) are never reported converged, and the
    sequential fallback returns them exactly."""

    class Huge(eqx.Module):
        def __call__(self, x, h):
            return jnp.full_like(h, 1e20) + x[0]

    xs, h0 = jnp.zeros((12, 1), jnp.float32), jnp.zeros(2, jnp.float32)
    exact = scan_cell(Huge(), xs, h0)
    assert jnp.all(jnp.isfinite(exact)) and jnp.all(exact > jnp.sqrt(3.4e38))
    for make in (pscan.Picard, pscan.Newton):
        sol = pscan.recurrence(
            Huge(), xs, h0, solver=make(chunk_size=4, max_iters=8), throw=False
        )
        assert sol.result == pscan.RESULTS.max_iters_reached
        assert sol.stats["max_residual"] == jnp.inf
        assert int(sol.stats["num_at_bound"]) == 8  # every sweep held a start there
        fallback = make(chunk_size=4, max_iters=8, fallback="sequential")
        sol = pscan.recurrence(Huge(), xs, h0, solver=fallback)
        assert sol.stats["fell_back"] and jnp.array_equal(sol.hs, exact)


@pytest.mark.parametrize("solver", SHOOTING)
def test_gradient_of_nonfinite_start_is_nan(solver):
    """A non-finite initial state: every cotangent is NaN, as through `lax.scan`
    (the implicit adjoint skips its work rather than return numbers)."""
    cell, _ = make_cell("gru")
    xs, h0 = make_xs(11), jnp.array([jnp.inf, 0.1, 0.2, 0.3])

    def loss(run):
        return lambda c, xs, h0: jnp.sum(run(c, xs, h0))

    run = lambda c, xs, h0: (
        pscan.recurrence(c, xs, h0, solver=SOLVERS[solver], throw=False).hs
    )
    for f in (loss(run), loss(scan_cell)):
        g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(cell, xs, h0)
        assert all(jnp.all(jnp.isnan(x)) for x in jax.tree_util.tree_leaves(g))


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: pscan.Picard(chunk_size=0),
            r"Picard: `chunk_size` must be a positive int, got 0",
        ),
        (lambda: pscan.Picard(max_iters=0), r"Picard: `max_iters`"),
        (
            lambda: pscan.Picard(rtol=-1.0),
            r"Picard: `rtol` must be a non-negative number",
        ),
        (
            lambda: pscan.Picard(fallback="exact"),
            r"Picard: `fallback` must be None or 'sequential'",
        ),
        (lambda: pscan.Newton(chunk_size=2.5), r"Newton: `chunk_size`"),
        (lambda: pscan.Newton(atol=float("nan")), r"Newton: `atol`"),
        (
            lambda: pscan.Newton(jacobian="full"),
            r"Newton: `jacobian` must be 'dense' or 'diagonal'",
        ),
        (lambda: pscan.Newton(damping=1.0), r"Newton: `damping` must be in \[0, 1\)"),
        (lambda: pscan.Sequential(checkpoint=0), r"Sequential: `checkpoint`"),
        (lambda: pscan.Sequential(unroll=0), r"Sequential: `unroll`"),
    ],
)
def test_invalid_solver_options(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_input():
    cell, h0 = make_cell("elman")
    xs = make_xs(10)
    with pytest.raises(ValueError, match="`solver` must be a pscan solver.*'newton'"):
        pscan.recurrence(cell, xs, h0, solver="newton")
    # a solver class, not an instance: the call that was meant
    with pytest.raises(
        ValueError, match=r"class pscan.Newton itself.*pscan.Newton\(\)"
    ):
        pscan.recurrence(cell, xs, h0, solver=pscan.Newton)
    with pytest.raises(
        ValueError, match=r"share one nonzero leading.*\(10, 2\), \(9,\)"
    ):
        pscan.recurrence(lambda x, h: h, (xs, jnp.ones(9)), h0)
    with pytest.raises(ValueError, match="leading time axis"):
        pscan.recurrence(cell, jnp.ones(()), h0)
    with pytest.raises(ValueError, match="must return a state like `h0`"):
        pscan.recurrence(lambda x, h: jnp.concatenate([h, h]), xs, h0)
    with pytest.raises(ValueError, match="`h0` must be a pytree of floating"):
        pscan.recurrence(cell, xs, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"`cell\(x_t, h\)` failed"):
        pscan.recurrence(cell, make_xs(10, n_in=3), h0)
    # flags are Python bools: a string is not read as its truth value, an array
    # (traced or not) cannot decide the program's shape
    with pytest.raises(ValueError, match=r"`throw` must be True or False, got 'False'"):
        pscan.recurrence(cell, xs, h0, throw="False")
    with pytest.raises(
        ValueError, match=r"`reverse` must be True or False.*shape \(\)"
    ):
        jax.jit(lambda r: pscan.recurrence(cell, xs, h0, reverse=r))(True)
    assert_allclose(  # a NumPy bool is a bool
        pscan.recurrence(cell, xs, h0, reverse=np.True_).hs,
        pscan.recurrence(cell, xs, h0, reverse=True).hs,
    )


@pytest.mark.parametrize("solver", ["picard", "shooting"])
def test_pytree_inputs_and_states(solver):
    """Inputs and states may be any pytrees (here a dict of inputs, a tuple state)."""

    class Cell(eqx.Module):
        inner: eqx.nn.LSTMCell

        def __call__(self, x, h):
            return self.inner(x["u"] * x["scale"][0], h)

    inner, h0 = make_cell("lstm")
    xs = {"u": make_xs(LENGTH), "scale": jnp.linspace(0.5, 1.5, LENGTH)[:, None]}
    sol = solve(Cell(inner), xs, h0, solver=SOLVERS[solver])
    ref = scan_cell(Cell(inner), xs, h0)
    for x, y in zip(sol.hs, ref):
        assert_allclose(x, y)
    g = eqx.filter_jit(
        eqx.filter_grad(lambda xs: _loss(Cell(inner), xs, h0, SOLVERS[solver]))
    )(xs)
    g_ref = eqx.filter_grad(lambda xs: _scan_loss(Cell(inner), xs, h0))(xs)
    assert_allclose(g["scale"], g_ref["scale"])


def test_user_written_solver():
    """A solver written against the public `pscan.Problem` (the docs' example)."""

    class MySequential(pscan.AbstractSolver):
        def solve(self, problem):
            hs, _ = problem.scan(problem.h0, problem.xs)
            stats = {
                "num_iterations": jnp.array(0),
                "max_residual": jnp.array(0.0),
                "fell_back": jnp.array(False),
            }
            return hs, pscan.RESULTS.successful, stats

    cell, h0 = make_cell("gru")
    xs = make_xs(LENGTH)
    sol = solve(cell, xs, h0, solver=MySequential())
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))
    g = eqx.filter_grad(lambda c: _loss(c, xs, h0, MySequential()))(cell)
    g_ref = eqx.filter_grad(lambda c: _scan_loss(c, xs, h0))(cell)
    assert_allclose(g.weight_hh, g_ref.weight_hh)


# ---------------------------------------------------------------------------------------
# Honest results: non-finite states, pure relative tolerance, the fallback's states
# ---------------------------------------------------------------------------------------

NONFINITE_SOLVERS = {
    "sequential": pscan.Sequential(),
    "picard": pscan.Picard(chunk_size=4, **TIGHT),
    "deer": pscan.Newton(**TIGHT),
    "quasi-deer": pscan.Newton(jacobian="diagonal", **TIGHT),
    "shooting": pscan.Newton(chunk_size=4, **TIGHT),
    "fallback": pscan.Newton(chunk_size=4, max_iters=2, fallback="sequential", **TIGHT),
    "elk-fallback": pscan.ELK(
        chunk_size=4, max_iters=2, fallback="sequential", **TIGHT
    ),
}


@pytest.mark.parametrize(
    "solver", NONFINITE_SOLVERS.values(), ids=NONFINITE_SOLVERS.keys()
)
def test_nonfinite_input_flagged_and_earlier_states_exact(solver):
    """A NaN input at step 21: every solver returns the sequential loop's states (exact
    before the NaN, NaN from it on), flags `nonfinite` without raising (also with
    `throw=True`), and `max_residual` never reads as converged."""
    cell, h0 = make_cell("gru")
    xs = make_xs(LENGTH).at[21, 0].set(jnp.nan)
    ref = scan_cell(cell, xs, h0)
    for throw in (False, True):
        sol = solve(cell, xs, h0, solver=solver, throw=throw)
        assert sol.result == pscan.RESULTS.nonfinite
        assert not float(sol.stats["max_residual"]) <= 1
        np.testing.assert_array_equal(np.isnan(sol.hs), np.isnan(ref))
        assert_allclose(sol.hs[:21], ref[:21])


LONG_NONFINITE_SOLVERS = {
    "picard": pscan.Picard(chunk_size=4, **TIGHT),
    "deer": pscan.Newton(**TIGHT),
    "shooting": pscan.Newton(chunk_size=4, **TIGHT),
    "elk": pscan.ELK(chunk_size=4, **TIGHT),
}


@pytest.mark.parametrize(
    "solver", LONG_NONFINITE_SOLVERS.values(), ids=LONG_NONFINITE_SOLVERS.keys()
)
def test_nonfinite_input_flagged_on_a_long_sequence(solver):
    """The same with T = 20000 (K d >= 20000 entries in the checks of the starts): a
    finiteness check built on a max reduction, which XLA CPU's vectorised code lets
    drop a NaN, returned wrong states there (ELK's, before the NaN) and no flag."""
    cell = to_dtype(eqx.nn.GRUCell(1, 4, key=jax.random.PRNGKey(0)), jnp.float64)
    h0 = jnp.zeros(4)
    xs = make_xs(20000, n_in=1).at[10000, 0].set(jnp.nan)
    ref = scan_cell(cell, xs, h0)
    sol = solve(cell, xs, h0, solver=solver, throw=False)
    assert sol.result == pscan.RESULTS.nonfinite
    np.testing.assert_array_equal(np.isnan(sol.hs), np.isnan(ref))
    assert_allclose(sol.hs[:10000], ref[:10000])


@pytest.mark.parametrize("make", [pscan.Picard, pscan.Newton, pscan.ELK])
def test_pure_relative_tolerance(make):
    """`atol=0` with states that are exactly zero: no 0/0, converges as usual."""

    class HalfZero(eqx.Module):
        inner: ElmanCell

        def __call__(self, x, h):
            return self.inner(x, h).at[:2].set(0.0)

    inner, h0 = make_cell("elman")
    cell = HalfZero(inner)
    xs = make_xs(LENGTH)
    solver = make(chunk_size=8, rtol=1e-10, atol=0.0)
    sol = solve(cell, xs, h0, solver=solver)
    assert sol.result == pscan.RESULTS.successful
    assert int(sol.stats["num_iterations"]) > 1  # 0/0 once stopped it after one
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))


@pytest.mark.parametrize("make", [pscan.Newton, pscan.ELK])
def test_fallback_returns_the_sequential_states(make):
    """`fallback="sequential"` returns exactly what `Sequential()` returns, bit for bit
    (on a chaotic float32 cell, rerunning chunks from sequential starts would not)."""
    cell, h0 = _chaotic()
    cell, h0 = to_dtype(cell, jnp.float32), h0.astype(jnp.float32)
    xs = make_xs(60, dtype=jnp.float32)
    fb = make(chunk_size=4, max_iters=2, fallback="sequential")
    sol = solve(cell, xs, h0, solver=fb)
    assert bool(sol.stats["fell_back"])
    np.testing.assert_array_equal(sol.hs, solve(cell, xs, h0).hs)


def test_numpy_integer_hyperparameters():
    solver = pscan.Newton(chunk_size=np.int64(8), max_iters=np.int32(20))
    cell, h0 = make_cell("gru")
    xs = make_xs(LENGTH)
    assert_allclose(solve(cell, xs, h0, solver=solver).hs, scan_cell(cell, xs, h0))


WARM = {
    "picard": pscan.Picard(chunk_size=8, rtol=1e-8, atol=1e-8),
    "shooting": pscan.Newton(chunk_size=8, rtol=1e-8, atol=1e-8),
    "deer": pscan.Newton(rtol=1e-8, atol=1e-8),
    "elk": pscan.ELK(chunk_size=2, rtol=1e-8, atol=1e-8),
}


@pytest.mark.parametrize("solver", WARM.values(), ids=WARM.keys())
def test_warm_start(solver):
    """`guess=` the answer of a nearby problem (as after a training step): the same
    answer, fewer iterations, the exact gradient; a bad guess is refused."""
    cell, h0 = make_cell("gru")
    xs = make_xs(LENGTH)
    previous = solve(cell, xs, h0).hs
    moved = jax.tree_util.tree_map(
        lambda x: x * 1.001 if eqx.is_inexact_array(x) else x, cell
    )
    exact = scan_cell(moved, xs, h0)
    close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    cold = solve(moved, xs, h0, solver=solver)
    warm = solve(moved, xs, h0, solver=solver, guess=previous)
    close(warm.hs, exact)
    assert int(warm.stats["num_iterations"]) < int(cold.stats["num_iterations"])
    loss = lambda c, **kw: jnp.sum(
        pscan.recurrence(c, xs, h0, solver=solver, **kw).hs ** 2
    )
    g = eqx.filter_jit(eqx.filter_grad(lambda c: loss(c, guess=previous)))(moved)
    g_ref = eqx.filter_grad(lambda c: jnp.sum(scan_cell(c, xs, h0) ** 2))(moved)
    close(g.weight_hh, g_ref.weight_hh)
    # a non-finite guess only costs iterations
    sol = solve(moved, xs, h0, solver=solver, guess=previous.at[5].set(jnp.nan))
    close(sol.hs, exact)
    with pytest.raises(ValueError, match=r"`guess` must be like the states"):
        pscan.recurrence(moved, xs, h0, solver=solver, guess=previous[:-1])
    with pytest.raises(ValueError, match=r"`guess` is complex \(complex128\) but the"):
        pscan.recurrence(moved, xs, h0, solver=solver, guess=previous + 0j)


class _ComplexCell(eqx.Module):
    """A complex state and a cell that is not holomorphic in it (`conj`)."""

    w: jax.Array

    def __call__(self, x, h):
        return 0.6 * jnp.tanh(self.w * jnp.conj(h)) + x[0] * (1 + 0.5j)


@pytest.mark.parametrize("solver", SOLVERS.values(), ids=SOLVERS.keys())
def test_complex_states(solver):
    """Complex states through every solver: values and gradients (wrt the cell, xs and
    h0) against `lax.scan` autodiff; the solvers see real `2d` vectors."""
    cell = _ComplexCell(jnp.array([0.8 + 0.3j, -0.5 + 0.6j, 0.2 - 0.9j]))
    xs = make_xs(LENGTH)
    h0 = jnp.array([0.1 + 0.2j, -0.3j, 0.5], jnp.complex128)
    sol = solve(cell, xs, h0, solver=solver)
    assert sol.hs.dtype == jnp.complex128
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))

    # forward mode: a complex tangent of h0, a real one of xs
    assert_exact_derivatives(
        solver,
        cell,
        xs,
        h0,
        scalar=lambda hs: jnp.sum(jnp.abs(hs) ** 2),
        tangents=(jnp.cos(xs), jnp.array([1.0, 1j, 0.5 - 0.5j])),
        leaf=lambda c: c.w,
    )


@pytest.mark.parametrize("solver", ["picard", "shooting", "quasi-deer", "elk"])
def test_cell_closing_over_parameters(solver):
    """A plain function closing over an array that is differentiated (not a module):
    exact gradients and tangents through the implicit rules, as `lax.scan`'s."""
    w = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (3, 3), jnp.float64)
    xs = make_xs(LENGTH, n_in=3)
    h0 = 0.1 * jnp.ones(3)

    def loss(w, solver):
        cell = lambda x, h: jnp.tanh(w @ h + x)
        hs = pscan.recurrence(cell, xs, h0, solver=solver).hs
        return jnp.sum(jnp.sin(hs))

    ours, exact = SOLVERS[solver], pscan.Sequential()
    grad = eqx.filter_jit(jax.grad(loss))
    assert_allclose(grad(w, ours), grad(w, exact))
    jvp = eqx.filter_jit(lambda s: jax.jvp(lambda w: loss(w, s), (w,), (jnp.cos(w),)))
    assert_allclose(jvp(ours)[1], jvp(exact)[1])
    batch = jnp.stack([w, -w])
    g = eqx.filter_jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(batch, ours)
    assert_allclose(g[1], grad(-w, exact))


@pytest.mark.parametrize("kind", ["module", "function"])
@pytest.mark.parametrize(
    "solver, highest",
    [
        # Newton's Jacobians in one pass with the ends (off CPU its default builds
        # them apart at the default precision: test_jacobians_at_their_own_precision)
        (pscan.Newton(chunk_size=4, jacobian_precision=None), True),
        (
            pscan.Newton(chunk_size=4, jacobian="diagonal", jacobian_precision=None),
            True,
        ),
        (pscan.ELK(chunk_size=4), True),
        (pscan.Picard(chunk_size=4), True),
        (pscan.Newton(chunk_size=4, precision=None), False),
        (pscan.Picard(chunk_size=4, precision=None), False),
        (pscan.Sequential(), False),
    ],
)
def test_chunked_solvers_run_the_cell_at_full_precision(kind, solver, highest):
    # the cell's products inside the solve and its gradient take the solver's
    # precision: on a TPU the default (bfloat16 passes) spoils Newton's Jacobians, and
    # Picard's states (batched over the chunks, where a loop's products are exact). A
    # function cell is traced (closure-converted) under it too. On CPU the precision
    # changes no number; the jaxpr says what runs on an accelerator
    gru = eqx.nn.GRUCell(1, 4, key=jax.random.PRNGKey(0))
    w = jnp.full((4, 4), 0.1)
    cell = gru if kind == "module" else (lambda x, h: jnp.tanh(w @ h + x))
    xs, h0 = jnp.ones((10, 1)), jnp.zeros(4)
    states = lambda xs: pscan.recurrence(cell, xs, h0, solver=solver).hs
    grad = jax.grad(lambda xs: jnp.sum(states(xs) ** 2))
    full = (jax.lax.Precision.HIGHEST,) * 2
    for fn in (states, grad):
        precisions = dot_precisions(fn, xs)
        assert precisions
        if highest:
            assert all(p == full for p in precisions)
        else:  # the caller's default, but for pscan's own linear algebra
            assert None in precisions
    # the states are the same on CPU
    assert_allclose(states(xs), scan_cell(cell, xs, h0), jnp.float32)


def test_precision_is_checked():
    for solver in (pscan.Newton, pscan.ELK, pscan.Picard):
        with pytest.raises(ValueError, match="precision"):
            solver(precision="very high")
    for solver in (pscan.Newton, pscan.ELK):
        with pytest.raises(ValueError, match="jacobian_precision"):
            solver(jacobian_precision="very high")
    assert pscan.Newton(precision="float32").matrix_precision() == "float32"
    assert pscan.Picard(precision=None).matrix_precision() is None
    assert pscan.Sequential().matrix_precision() is None


def test_x64_disabled():
    """With `jax_enable_x64` off (JAX's default), the iterating solvers run in float32
    from float64 NumPy inputs: states, gradients and tangents float32 and right (their
    loops' counters and flags are int32 and bool there)."""
    code = """
import equinox as eqx, jax, jax.numpy as jnp, numpy as np, pscan
assert not jax.config.jax_enable_x64
cell = eqx.nn.GRUCell(2, 4, key=jax.random.PRNGKey(0))
xs = np.random.default_rng(0).normal(size=(23, 2))
scan = lambda c, xs: jax.lax.scan(lambda h, x: (c(x, h),) * 2, jnp.zeros(4), xs)[1]
ref = scan(cell, jnp.asarray(xs, jnp.float32))
loss = lambda f: lambda c: jnp.sum(f(c, jnp.asarray(xs, jnp.float32)) ** 2)
g_ref = eqx.filter_grad(loss(scan))(cell).weight_hh
x32 = jnp.asarray(xs, jnp.float32)
step = lambda h0: jax.lax.scan(lambda h, x: (cell(x, h),) * 2, h0, x32)[1]
t_ref = jax.jvp(step, (jnp.zeros(4),), (jnp.ones(4),))[1]
for solver in (pscan.Picard(chunk_size=4), pscan.Newton(chunk_size=4),
               pscan.ELK(chunk_size=4, jacobian="diagonal")):
    f = lambda c, xs: pscan.recurrence(c, xs, np.zeros(4), solver=solver).hs
    hs = f(cell, xs)
    assert hs.dtype == jnp.float32, hs.dtype
    np.testing.assert_allclose(hs, ref, rtol=1e-4, atol=1e-4)
    g = eqx.filter_grad(loss(f))(cell).weight_hh
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g_ref, rtol=1e-3, atol=1e-4)
    t = jax.jvp(lambda h0: pscan.recurrence(cell, xs, h0, solver=solver).hs,
                (jnp.zeros(4),), (jnp.ones(4),))[1]
    assert t.dtype == jnp.float32
    np.testing.assert_allclose(t, t_ref, rtol=1e-3, atol=1e-4)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # as this process compiles
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("kind", ["module", "function"])
@pytest.mark.parametrize(
    "solver",
    [
        pscan.Newton(chunk_size=4),
        pscan.Newton(),
        pscan.Newton(chunk_size=3, jacobian="diagonal"),
        pscan.ELK(chunk_size=4, jacobian_precision="default"),
        pscan.ELK(jacobian="diagonal", jacobian_precision="default"),
    ],
)
def test_jacobians_at_their_own_precision(kind, solver, monkeypatch):
    # off CPU, the forward iteration's Jacobians are traced at `jacobian_precision`
    # (Newton's default: "default"), apart from the chunk ends at `precision`; a
    # function cell closed over arrays is converted at both. Forced here (CPU
    # products are exact whatever the precision): the jaxpr holds both, the numbers
    # are those of the loop, and so are the gradients, the closed-over arrays'
    # included
    monkeypatch.setattr(pscan._precision, "_products_exact", lambda: False)
    key = jax.random.PRNGKey(3)
    gru = eqx.nn.GRUCell(1, 4, key=key)
    w = 0.4 * jax.random.normal(key, (4, 4))
    xs, h0 = jax.random.normal(key, (23, 1)), jnp.zeros(4)

    def states(w, xs, solver=solver):
        cell = gru if kind == "module" else (lambda x, h: jnp.tanh(w @ h + x[0]))
        return pscan.recurrence(cell, xs, h0, solver=solver).hs

    loss = lambda w, xs, solver=solver: jnp.sum(jnp.sin(states(w, xs, solver)))
    full, default = (jax.lax.Precision.HIGHEST,) * 2, (jax.lax.Precision.DEFAULT,) * 2
    precisions = set(dot_precisions(states, w, xs))
    assert precisions == {full, default}
    one_pass = dataclasses.replace(solver, jacobian_precision=None)
    assert set(dot_precisions(lambda w, xs: states(w, xs, one_pass), w, xs)) == {full}
    # the derivatives: exact Jacobians (which solve the boundary recurrence at once)
    # at `precision`, a diagonal preconditioner at the Jacobians' own
    hs, pull = jax.vjp(states, w, xs)
    exact = solver.linearisation().exact
    assert set(dot_precisions(pull, hs)) == ({full} if exact else {full, default})
    sequential = pscan.Sequential()
    assert_allclose(states(w, xs), states(w, xs, sequential), jnp.float32)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for g, ref in zip(grad(w, xs, solver), grad(w, xs, sequential)):
        assert_allclose(g, ref, jnp.float32)


@pytest.mark.parametrize("kind", ["module", "function"])
def test_jacobians_at_their_own_precision_with_segments(kind, monkeypatch):
    # the separate Jacobian pass runs through the masked step of packed and padded
    # series too (the function cell's Jacobian copy inside it): the loop's states
    monkeypatch.setattr(pscan._precision, "_products_exact", lambda: False)
    key = jax.random.PRNGKey(5)
    gru = eqx.nn.GRUCell(1, 3, key=key)
    w = 0.5 * jax.random.normal(key, (3, 3))
    cell = gru if kind == "module" else (lambda x, h: jnp.tanh(w @ h + x[0]))
    xs, h0 = jax.random.normal(key, (19, 1)), jnp.zeros(3)
    resets = jnp.zeros(19, bool).at[jnp.array([5, 6, 13])].set(True)
    run = lambda solver: (
        pscan.recurrence(cell, xs, h0, solver=solver, resets=resets, length=17).hs
    )
    solver = pscan.Newton(chunk_size=4)
    assert set(dot_precisions(lambda xs: run(solver), xs)) == {
        (jax.lax.Precision.HIGHEST,) * 2,
        (jax.lax.Precision.DEFAULT,) * 2,
    }
    assert_allclose(run(solver), run(pscan.Sequential()), jnp.float32)


@pytest.mark.parametrize("solver", ["sequential", "shooting", "elk"])
def test_eager_calls_compile_once(solver):
    """Called eagerly, a solve is compiled once for a configuration: a later call with
    new inputs, a new initial state and a cell of new values (the same shapes and
    structure) compiles nothing and gives its own answer; a new shape compiles."""
    cell, h0 = make_cell("gru")
    xs = make_xs(LENGTH)
    run = lambda c, x, h: pscan.recurrence(c, x, h, solver=SOLVERS[solver]).hs
    run(cell, xs, h0)
    moved = jax.tree_util.tree_map(lambda x: 1.01 * x, cell)
    xs2, h02 = xs + 0.5, h0 - 0.2
    with compiles() as names:
        hs = run(moved, xs2, h02)
    assert names == []
    assert_allclose(hs, scan_cell(moved, xs2, h02))
    with compiles() as names:
        run(cell, xs[:-1], h0)
    assert names


_GLOBAL_W = 0.5 * jnp.eye(3)


def _global_cell(x, h):  # reads a global: no closure, a function of its module
    return jnp.tanh(_GLOBAL_W @ h + x)


@pytest.mark.parametrize("solver", ["sequential", "shooting"])
def test_eager_function_cell_reads_globals_afresh(solver, monkeypatch):
    """A plain-function cell is traced at every eager call: a global it reads, changed
    between two calls, changes the answer (a program compiled once would keep the
    first value: a stale answer, silently)."""
    xs = make_xs(LENGTH, n_in=3)
    h0 = jnp.zeros(3)
    run = lambda: pscan.recurrence(_global_cell, xs, h0, solver=SOLVERS[solver]).hs
    assert_allclose(run(), scan_cell(_global_cell, xs, h0))
    monkeypatch.setattr(sys.modules[__name__], "_GLOBAL_W", -0.7 * jnp.eye(3))
    assert_allclose(run(), scan_cell(_global_cell, xs, h0))
