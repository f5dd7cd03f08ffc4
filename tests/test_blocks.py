import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pscan
from pscan._blocks import _gauss_jordan, block_matmul, block_solve_spd

from .helpers import (
    assert_allclose,
    dot_precisions,
    make_linear_problem,
    random_cotangent,
    reference_linear,
)


@pytest.fixture
def tpu(traced_as):
    """Traced as for a TPU (see `traced_as`)."""
    traced_as("tpu")


def _draw(seed, shape, dtype):
    return random_cotangent(seed, jnp.zeros(shape, dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.complex64, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_block_matmul_is_matmul(traced_as, backend, dtype):
    """The product of every pair of blocks, batch axes broadcast, blocks not square,
    in the inputs' dtype: by `jnp.matmul` on CPU (one matrix product at full
    precision), and traced as for a TPU elementwise, without a matrix product."""
    traced_as(backend)
    a = _draw(0, (5, 1, 3, 4), dtype)
    b = _draw(1, (1, 6, 4, 2), dtype)
    out = block_matmul(a, b)
    assert out.shape == (5, 6, 3, 2) and out.dtype == a.dtype
    wide = np.complex128 if jnp.iscomplexobj(a) else np.float64
    expect = np.matmul(np.asarray(a, wide), np.asarray(b, wide))
    rtol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, wide), expect, rtol=rtol, atol=rtol)
    dots = dot_precisions(lambda a, b: block_matmul(a, b), a, b)
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    assert dots == ([] if backend == "tpu" else [highest])


def test_wide_blocks_keep_the_matrix_product(tpu):
    """Blocks wider than 32 keep `jnp.matmul` at full precision on a TPU too."""
    a = _draw(0, (2, 33, 33), np.float32)
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    product = lambda a, b: block_matmul(a, b)
    assert dot_precisions(product, a, a) == [highest]
    assert dot_precisions(product, a[:, :32, :32], a[:, :32, :32]) == []


@pytest.mark.parametrize("reverse", [False, True])
def test_dense_recurrence_as_traced_for_a_tpu(tpu, monkeypatch, reverse):
    """The dense linear recurrence traced as for a TPU, whose chunked method composes
    the coefficients elementwise: the float64 loop's states, at lengths that are not
    a multiple of the chunk size, and exact first derivatives (the transpose is the
    same method in reverse)."""
    backends = []
    product = pscan._linear.block_matmul
    spy = lambda a, b: backends.append(jax.default_backend()) or product(a, b)
    monkeypatch.setattr(pscan._linear, "block_matmul", spy)
    for length in (1, 2, 97, 1000):
        a, b, h0 = make_linear_problem(length, length, (5,), "dense")
        solve = lambda a, b, h0: pscan.linear_recurrence(
            a, b, h0, reverse=reverse, method="chunked", chunk_size=16
        )
        assert_allclose(solve(a, b, h0), reference_linear(a, b, h0, reverse))
    check_grads(solve, (a[:97], b[:97], h0), order=1, modes=("fwd", "rev"))
    assert backends and set(backends) == {"tpu"}


def test_gauss_jordan_solves_like_lu():
    """The TPU's solve of the dense Kalman combine: batches of blocks, against LU
    (float64), a block that needs row exchanges (a zero pivot), complex blocks."""
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    m = jax.random.normal(keys[0], (3, 2, 6, 6), jnp.float64)
    b = jax.random.normal(keys[1], (3, 2, 6, 4), jnp.float64)
    assert_allclose(_gauss_jordan(m, b), jnp.linalg.solve(m, b))
    swap = jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    assert_allclose(_gauss_jordan(swap, jnp.eye(3)), jnp.linalg.inv(swap))
    mc = m + 1j * jax.random.normal(keys[2], m.shape, jnp.float64)
    bc = b + 1j * jax.random.normal(keys[3], b.shape, jnp.float64)
    assert_allclose(_gauss_jordan(mc, bc), jnp.linalg.solve(mc, bc))


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_spd_solve_solves_like_lu(backend, traced_as):
    """The smoother's gains, `(F P F^T + I)^{-1} F P`, by Cholesky (on a TPU, by
    elimination): against LU (float64, batches of blocks), in bfloat16 (factorised in
    float32, by either), and complex blocks, which are not Hermitian there and go to
    LU."""
    traced_as(backend)
    keys = jax.random.split(jax.random.PRNGKey(6), 4)
    f = jax.random.normal(keys[0], (3, 2, 6, 6), jnp.float64)
    p = jax.random.normal(keys[1], (3, 2, 6, 6), jnp.float64)
    p = p @ jnp.swapaxes(p, -1, -2)
    s = f @ p @ jnp.swapaxes(f, -1, -2) + jnp.eye(6)
    b = f @ p
    assert_allclose(block_solve_spd(s, b), jnp.linalg.solve(s, b))
    s16, b16 = s.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    half = block_solve_spd(s16, b16)
    assert half.dtype == jnp.bfloat16
    wide = jnp.linalg.solve(s16.astype(jnp.float32), b16.astype(jnp.float32))
    assert jnp.max(jnp.abs(half - wide)) <= 1e-2 * jnp.max(jnp.abs(wide))
    sc = s + 1j * jax.random.normal(keys[2], s.shape, jnp.float64)
    bc = b + 1j * jax.random.normal(keys[3], b.shape, jnp.float64)
    assert_allclose(block_solve_spd(sc, bc), jnp.linalg.solve(sc, bc))
