import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pscan
from pscan._blocks import block_matmul

from .helpers import (
    assert_allclose,
    dot_precisions,
    make_linear_problem,
    random_cotangent,
    reference_linear,
)


@pytest.fixture
def tpu(monkeypatch):
    """Traced as for a TPU: `jax.default_backend()` says so, and no program traced
    for the CPU is reused (nor one traced here afterwards)."""
    jax.clear_caches()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    yield
    jax.clear_caches()


def _draw(seed, shape, dtype):
    return random_cotangent(seed, jnp.zeros(shape, dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.complex64, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_block_matmul_is_matmul(monkeypatch, backend, dtype):
    """The product of every pair of blocks, batch axes broadcast, blocks not square,
    in the inputs' dtype: by `jnp.matmul` on CPU (one matrix product at full
    precision), and traced as for a TPU elementwise, without a matrix product."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
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
