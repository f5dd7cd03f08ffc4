"""The public solver protocol: a solver written here, with public names only (a
damped Picard iteration whose damping, carried as solver state, relaxes as it goes),
solves exactly and gets exact implicit gradients and tangents."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import pscan

from .helpers import assert_allclose, assert_exact_derivatives, scan_cell


class DampedPicard(pscan.AbstractShootingSolver):
    """`s <- s + w (sweep(s) - s)`, the weight `w` from `relax`, times `grow` after
    every step (at most 1: plain Picard)."""

    chunk_size: int = eqx.field(static=True, default=4)
    max_iters: int = eqx.field(static=True, default=400)
    rtol: float = eqx.field(static=True, default=1e-12)
    atol: float = eqx.field(static=True, default=1e-12)
    fallback: str | None = eqx.field(static=True, default=None)
    axis_name: str | None = eqx.field(static=True, default=None)
    relax: float = eqx.field(static=True, default=0.5)
    grow: float = eqx.field(static=True, default=1.5)

    def init(self, chunks, starts):
        return jnp.asarray(self.relax, starts.real.dtype)

    def step(self, chunks, starts, weight):
        ends = chunks.ends(starts)
        new = starts + weight * (chunks.shift(ends) - starts)
        return new, jnp.minimum(1.0, self.grow * weight), ends


def _problem(length=23):
    cell = eqx.nn.GRUCell(2, 3, key=jax.random.PRNGKey(0), dtype=jnp.float64)
    xs = jax.random.normal(jax.random.PRNGKey(1), (length, 2), jnp.float64)
    return cell, xs, 0.1 * jnp.ones(3)


@pytest.mark.parametrize("length", [1, 23])
def test_custom_solver_is_exact(length):
    cell, xs, h0 = _problem(length)
    solver = DampedPicard()
    sol = eqx.filter_jit(pscan.recurrence)(cell, xs, h0, solver=solver)
    assert sol.result == pscan.RESULTS.successful
    assert_allclose(sol.hs, scan_cell(cell, xs, h0))
    # gradients (implicit: products with the exact Jacobian) and tangents
    assert_exact_derivatives(solver, cell, xs, h0)


def test_solver_state_is_carried():
    """The weight carried from step to step: relaxing towards plain Picard takes
    fewer steps than keeping the first weight, more than plain Picard; all exact;
    and under `vmap`."""
    cell, xs, h0 = _problem()
    iterations = {}
    for name, solver in {
        "fixed": DampedPicard(grow=1.0),
        "relaxing": DampedPicard(),
        "picard": pscan.Picard(chunk_size=4, rtol=1e-12, atol=1e-12),
    }.items():
        sol = pscan.recurrence(cell, xs, h0, solver=solver)
        assert_allclose(sol.hs, scan_cell(cell, xs, h0))
        iterations[name] = int(sol.stats["num_iterations"])
    assert iterations["fixed"] > iterations["relaxing"] > iterations["picard"]
    batch = jnp.stack([xs, -xs])
    hs = jax.vmap(lambda x: pscan.recurrence(cell, x, h0, solver=DampedPicard()).hs)
    assert_allclose(hs(batch)[1], scan_cell(cell, -xs, h0))


def test_protocol_fields_are_checked():
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        DampedPicard(chunk_size=0)
    with pytest.raises(TypeError):

        class NoStep(pscan.AbstractShootingSolver):
            chunk_size: int = 4
            max_iters: int = 10
            rtol: float = 1e-6
            atol: float = 1e-6
            fallback: str | None = None
            axis_name: str | None = None

        NoStep()


@pytest.mark.parametrize("n", [5, 20000])
def test_scaled_change_of_nonfinite_entries_is_infinite(n):
    """The iterations' measure of change (the derivatives' boundary iterations see
    whatever their products give): a NaN or inf entry is never converged, at every
    size (XLA CPU's vectorised max reduction can drop a NaN); no change is 0, also
    where the scale is 0."""
    from pscan._solvers._iterate import scaled_change

    change = jax.jit(scaled_change)
    old = jnp.linspace(-1.0, 1.0, n)
    assert float(change(old, old, 0.0, 0.0)) == 0.0
    assert_allclose(change(old + 1e-3, old, 0.0, 1e-3), 1.0)
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        for at in (0, n // 2, n - 1):
            new = old.at[at].set(bad)
            assert float(change(new, old, 1e-6, 1e-6)) == float("inf"), (bad, at)
            assert float(change(new, new, 1e-6, 1e-6)) == float("inf"), (bad, at)


@pytest.mark.parametrize("length", [1, 4, 23])
def test_chunks_at_the_true_starts(length):
    """`pscan.Chunks` at the sequential run's own chunk starts: the ends are its
    states at the chunk ends, they imply those starts, and the chunk runs give every
    state (the padding of the last chunk left out)."""
    cell, xs, h0 = _problem(length)
    step = lambda params, x, h: params(x, h)
    chunks = pscan.Chunks(pscan.Problem(step, cell, xs, h0), 4, None)
    hs = scan_cell(cell, xs, h0)
    starts = jnp.concatenate([h0[None], hs[3::4]])[: -(-length // 4)]
    ends = chunks.ends(starts)
    assert_allclose(ends[:-1], hs[3::4][: len(ends) - 1])
    if length % 4 == 0:  # else the last chunk runs on past the end
        assert_allclose(ends[-1], hs[-1])
    assert_allclose(chunks.shift(ends), starts)
    assert_allclose(chunks.states(starts), hs)
