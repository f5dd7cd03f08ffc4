"""ELK and quasi-ELK: the sequential answer (float64, against `lax.scan`) at any chunk
size and length, exact implicit gradients, a trust radius that adapts, non-finite
data, and clear errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pscan
from pscan import _blocks

from .helpers import assert_allclose, assert_exact_derivatives, scan_cell, to_dtype

TIGHT = dict(rtol=1e-12, atol=1e-12)
SOLVERS = {
    "elk": pscan.ELK(**TIGHT),
    "quasi-elk": pscan.ELK(jacobian="diagonal", **TIGHT),
    "elk-chunked": pscan.ELK(chunk_size=5, **TIGHT),
    "quasi-elk-chunked": pscan.ELK(chunk_size=4, jacobian="diagonal", **TIGHT),
    "elk-smoother": pscan.ELK(kalman="smoother", **TIGHT),
}


def _problem(length, gain=1.0, d=4):
    cell = eqx.nn.GRUCell(2, d, key=jax.random.PRNGKey(0), dtype=jnp.float64)
    cell = eqx.tree_at(lambda c: c.weight_hh, cell, gain * cell.weight_hh)
    xs = jax.random.normal(jax.random.PRNGKey(length), (length, 2), jnp.float64)
    return cell, xs, 0.1 * jnp.ones(d)


@pytest.mark.parametrize("name", SOLVERS)
@pytest.mark.parametrize("length", [1, 2, 37])
def test_matches_sequential(name, length):
    cell, xs, h0 = _problem(length)
    sol = eqx.filter_jit(pscan.recurrence)(cell, xs, h0, solver=SOLVERS[name])
    assert sol.result == pscan.RESULTS.successful
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))


@pytest.mark.parametrize("name", ["elk", "quasi-elk-chunked"])
def test_gradients_and_tangents(name):
    assert_exact_derivatives(SOLVERS[name], *_problem(23))


def test_any_radius_is_exact_and_adapts():
    """Any first radius converges to the same answer: a tiny one is never slower than
    Newton's full step, which is always a candidate, and it grows (`stats["radius"]`);
    resets and vmap work as for every solver."""
    cell, xs, h0 = _problem(37)
    ref = scan_cell(cell, xs, h0)
    newton = pscan.recurrence(cell, xs, h0, solver=pscan.Newton(**TIGHT))
    for radius in (1e-3, 1e4):
        solver = pscan.ELK(radius=radius, **TIGHT)
        sol = pscan.recurrence(cell, xs, h0, solver=solver)
        assert_allclose(sol.hs, ref)
        its = int(sol.stats["num_iterations"])
        assert its <= int(newton.stats["num_iterations"]) + 1
        if radius < 1:
            assert float(sol.stats["radius"]) > radius
    # quasi-ELK keeps its radius (its model does not predict the residual), unless
    # asked to adapt; either way the answer is exact
    for adapt in (None, True):
        solver = pscan.ELK(jacobian="diagonal", radius=1e-3, adapt=adapt, **TIGHT)
        sol = pscan.recurrence(cell, xs, h0, solver=solver)
        assert_allclose(sol.hs, ref)
        kept = float(sol.stats["radius"]) == pytest.approx(1e-3)
        assert kept == (adapt is None)
    resets = jnp.arange(37) % 10 == 0
    sol = pscan.recurrence(cell, xs, h0, solver=SOLVERS["elk"], resets=resets)
    parts = [scan_cell(cell, xs[s : s + 10], h0) for s in range(0, 37, 10)]
    assert_allclose(sol.hs, jnp.concatenate(parts))
    many = jax.vmap(lambda x: pscan.recurrence(cell, x, h0, solver=SOLVERS["elk"]).hs)
    assert_allclose(many(jnp.stack([xs, -xs]))[1], scan_cell(cell, -xs, h0))


def test_chaotic_cell_converges():
    """A strongly chaotic cell (large recurrent gain): the trust region keeps every
    iterate finite and ELK reaches the sequential answer."""
    cell, xs, h0 = _problem(60, gain=8.0, d=6)
    solver = pscan.ELK(max_iters=61, **TIGHT)
    sol = pscan.recurrence(cell, xs, h0, solver=solver)
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))


def test_nonfinite_input_is_the_loops_answer():
    cell, xs, h0 = _problem(30)
    bad = xs.at[12, 0].set(jnp.nan)
    sol = pscan.recurrence(cell, bad, h0, solver=SOLVERS["elk-chunked"])
    assert sol.result == pscan.RESULTS.nonfinite
    ref = scan_cell(cell, bad, h0)
    assert_allclose(sol.hs[:12], ref[:12])
    assert not bool(jnp.any(jnp.isfinite(sol.hs[12:])))


def test_bad_arguments():
    with pytest.raises(ValueError, match="`jacobian` must be 'dense' or 'diagonal'"):
        pscan.ELK(jacobian="full")
    with pytest.raises(ValueError, match="`radius` must be None or a positive number"):
        pscan.ELK(radius=0.0)
    with pytest.raises(ValueError, match="`adapt` must be None, True or False"):
        pscan.ELK(adapt="yes")
    with pytest.raises(ValueError, match="`adapt` must be None, True or False, got 1"):
        pscan.ELK(adapt=1)  # a number is not a flag
    with pytest.raises(
        ValueError, match="`kalman` must be None, 'filter' or 'smoother'"
    ):
        pscan.ELK(kalman="rts")
    with pytest.raises(ValueError, match="cannot be combined with `axis_name`"):
        pscan.ELK(fallback="sequential", axis_name="time")


@pytest.mark.parametrize("jacobian", ["diagonal", "dense"])
def test_kalman_scan_methods_agree(jacobian):
    """The Kalman filter and smoother run by `pscan.associative_scan`: a loop, XLA's
    parallel scan or chunks give the same steps (iterations) and the same answer."""
    cell, xs, h0 = _problem(37, gain=2.0)
    ref = scan_cell(cell, xs, h0)
    iterations = set()
    for method in ("sequential", "associative", "chunked"):
        solver = pscan.ELK(jacobian=jacobian, method=method, **TIGHT)
        sol = eqx.filter_jit(pscan.recurrence)(cell, xs, h0, solver=solver)
        assert_allclose(sol.hs, ref)
        iterations.add(int(sol.stats["num_iterations"]))
    assert len(iterations) == 1
    with pytest.raises(ValueError, match="`method` must be one of"):
        pscan.ELK(method="parallel")


def test_exact_prefix_survives_starts_at_the_bound():
    """A strongly chaotic autoregressive GRU in float32 (the benchmarks' first cell):
    Newton's later chunk starts run to the float bound, ELK's never do (the damped
    step holds them); the rows observed exactly must stay exact, or the prefix stops
    growing; `ceil(T / chunk_size)` steps suffice."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    gru = eqx.nn.GRUCell(1, 8, key=k1, dtype=jnp.float32)
    gru = eqx.tree_at(lambda g: g.weight_hh, gru, 10.0 * gru.weight_hh)
    readout = 3.0 / 8**0.5 * jax.random.normal(k2, (8,), jnp.float32)

    def cell(x, h):
        return gru(jnp.reshape(readout @ h + x, (1,)), h)

    length, chunk = 5000, 16
    xs = 0.01 * jax.random.normal(jax.random.PRNGKey(9), (length, 1), jnp.float32)
    h0 = jnp.zeros(8, jnp.float32)
    chunks = -(-length // chunk)
    solver = pscan.ELK(chunk_size=chunk, rtol=0.0, atol=1e-5, max_iters=chunks + 1)
    sol = pscan.recurrence(cell, xs, h0, solver=solver, throw=False)
    assert sol.result == pscan.RESULTS.successful
    assert int(sol.stats["num_iterations"]) <= chunks + 1
    assert int(sol.stats["num_at_bound"]) == 0
    newton = pscan.Newton(chunk_size=chunk, rtol=0.0, atol=1e-5, max_iters=chunks + 1)
    runaway = pscan.recurrence(cell, xs, h0, solver=newton, throw=False)
    assert int(runaway.stats["num_at_bound"]) > 0
    prev = jnp.concatenate([h0[None], sol.hs[:-1]])
    assert float(jnp.max(jnp.abs(sol.hs - jax.vmap(cell)(xs, prev)))) < 1e-4
    # quasi-ELK, every step an unknown: within T + 1 steps too, within the tolerance
    # at the states as well as at the starts
    length = 600
    quasi = pscan.ELK(jacobian="diagonal", rtol=0.0, atol=1e-5, max_iters=length + 1)
    sol = pscan.recurrence(cell, xs[:length], h0, solver=quasi, throw=False)
    assert sol.result == pscan.RESULTS.successful
    assert int(sol.stats["num_at_bound"]) == 0
    prev = jnp.concatenate([h0[None], sol.hs[:-1]])
    assert float(jnp.max(jnp.abs(sol.hs - jax.vmap(cell)(xs[:length], prev)))) <= 1e-5


def test_tpu_path_matches_sequential(monkeypatch, traced_as):
    """What ELK runs on a TPU (the dense Kalman combine scanned in chunks, its blocks
    solved by elimination), traced here as if the backend were one: the sequential
    answer, in as many iterations as the default path."""
    cell, xs, h0 = _problem(37, gain=2.0)
    solver = SOLVERS["elk-smoother"]
    traced = []
    eliminate = _blocks._gauss_jordan
    spy = lambda m, b: traced.append(m.shape) or eliminate(m, b)
    monkeypatch.setattr(_blocks, "_gauss_jordan", spy)
    here = pscan.recurrence(cell, xs, h0, solver=solver)
    assert not traced
    traced_as("tpu")
    # chunks of about sqrt(K) / 3 rows, a power of 2 in 16..64
    sizes = [solver._scan_method(k) for k in (37, 2000, 10000, 50000)]
    assert sizes == [("chunked", c) for c in (16, 16, 32, 64)]
    diagonal = pscan.ELK(jacobian="diagonal")
    assert diagonal._scan_method(37) == ("sequential", None)
    sol = pscan.recurrence(cell, xs, h0, solver=solver)
    assert traced  # the filter's combine and the smoother's gains
    assert sol.result == pscan.RESULTS.successful
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))
    assert int(sol.stats["num_iterations"]) == int(here.stats["num_iterations"])


@pytest.mark.parametrize(
    "dtype, solver",
    [(jnp.bfloat16, pscan.ELK()), (jnp.float16, pscan.ELK(chunk_size=4))],
    ids=["bfloat16", "float16"],
)
def test_half_precision(dtype, solver):
    """Dense ELK in half precision (its Kalman combine's LU runs in float32: LAPACK
    has none in bfloat16 or float16): converged, the states of `Sequential` in that
    precision, a gradient of that dtype close to float32's."""
    cell, xs, h0 = _problem(37)
    half = lambda t: to_dtype(t, dtype)
    run = lambda solver, h0: pscan.recurrence(half(cell), half(xs), h0, solver=solver)
    exact = run(pscan.Sequential(), half(h0)).hs.astype(jnp.float64)
    sol = run(solver, half(h0))
    assert sol.result == pscan.RESULTS.successful and sol.hs.dtype == dtype
    close = lambda x, y, tol: np.testing.assert_allclose(
        np.asarray(x, np.float64), y, rtol=tol, atol=tol
    )
    close(sol.hs, exact, 2e-2)
    loss = lambda h0: jnp.sum(run(solver, h0).hs.astype(jnp.float32))
    g = jax.grad(loss)(half(h0))
    g_ref = jax.grad(lambda h0: jnp.sum(scan_cell(cell, xs, h0)))(h0)
    assert g.dtype == dtype
    close(g, g_ref, 5e-2)
