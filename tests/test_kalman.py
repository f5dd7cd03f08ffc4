"""The Kalman filter and smoother of ELK's damped step: the least-squares minimisers
they stand for (float64), by every scan method and block solve."""

import jax
import jax.numpy as jnp
import pytest

from pscan import _blocks
from pscan._solvers import _kalman
from pscan._solvers._jacobian import STRUCTURES

from .helpers import assert_allclose


@pytest.mark.parametrize("method", ["sequential", "associative"])
@pytest.mark.parametrize("backend", ["cpu", "tpu"])
@pytest.mark.parametrize("structure", ["dense", "diagonal"])
def test_kalman_steps_are_least_squares_minimisers(
    structure, backend, method, monkeypatch, traced_as
):
    """The damped steps against a direct least-squares solve (float64): the smoother's
    is the minimiser over all rows, the filter's row `k` the last row of the minimiser
    over rows `1..k` (the linearised residuals up to `k` and the distances to the
    observations, `1 / sigma^2` each); by the classic filter and smoother steps (a
    loop from the first row) or the general combine (the parallel scan); the dense
    blocks solved by LU and Cholesky, or (traced as for a TPU) all by the elimination
    that a TPU uses."""
    eliminated = []
    if backend == "tpu":
        traced_as("tpu")
        eliminate = _blocks._gauss_jordan
        spy = lambda m, b: eliminated.append(m.shape) or eliminate(m, b)
        monkeypatch.setattr(_blocks, "_gauss_jordan", spy)
    K, d = 7, 3
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    shape = (K - 1, d) if structure == "diagonal" else (K - 1, d, d)
    jac = jax.random.normal(keys[0], shape, jnp.float64)
    starts, ends = (jax.random.normal(k, (K, d), jnp.float64) for k in keys[1:3])
    y = jax.random.normal(keys[3], (K - 1, d), jnp.float64)
    sigma2 = jax.random.uniform(keys[4], (K - 1,), jnp.float64, 0.1, 10.0)
    alg = _kalman.ALGEBRA[STRUCTURES[structure]]
    # the first row is h0 (`starts[0]`), known exactly; the last Jacobian is unused
    jac_all = jnp.concatenate([jac, jnp.full_like(jac[:1], jnp.nan)])
    implied = jnp.concatenate([starts[:1], ends[:-1]])
    y_all = jnp.concatenate([starts[:1], y])
    kappa = jnp.concatenate([jnp.ones(1), 1 / (1 + sigma2)])
    step = lambda smooth: _kalman.kalman(
        alg,
        jac_all,
        ends,
        starts,
        implied,
        y_all,
        kappa,
        method,
        None,
        smooth,
        None,
    )[1:]
    mats = jax.vmap(jnp.diag)(jac) if structure == "diagonal" else jac

    def minimiser(n):  # over x_1..x_n
        rows, rhs = [], []

        def block(k, m):  # m at the columns of x_k
            return jnp.zeros((d, n * d)).at[:, (k - 1) * d : k * d].set(m)

        rows.append(block(1, jnp.eye(d)))
        rhs.append(ends[0])
        for k in range(1, n):
            rows.append(block(k + 1, jnp.eye(d)) - block(k, mats[k]))
            rhs.append(ends[k] - mats[k] @ starts[k])
        for k in range(1, n + 1):
            w = sigma2[k - 1] ** -0.5
            rows.append(block(k, w * jnp.eye(d)))
            rhs.append(w * y[k - 1])
        a, b = jnp.concatenate(rows), jnp.concatenate(rhs)
        return jnp.linalg.lstsq(a, b)[0].reshape(n, d)

    assert_allclose(step(True), minimiser(K - 1))
    filtered = jnp.stack([minimiser(n)[-1] for n in range(1, K)])
    assert_allclose(step(False), filtered)
    # every dense solve by elimination on a TPU, none elsewhere
    assert bool(eliminated) == (backend == "tpu" and structure == "dense")
