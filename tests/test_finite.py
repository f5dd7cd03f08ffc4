import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pscan._finite import finite_along, finite_everywhere

# 16000 and more: sizes where XLA CPU's vectorised max reduction dropped a NaN (a
# check built on it called such arrays finite)
SIZES = [1, 31, 16000, 100003]
BAD = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
@pytest.mark.parametrize("n", SIZES)
def test_finite_along_everything(n, dtype):
    check = jax.jit(finite_along)
    x = np.full(n, 3e38 if dtype != np.float64 else 1e300, dtype)  # large, finite
    assert bool(check(jnp.asarray(x)))
    for bad in BAD:
        for at in sorted({0, n // 2, n - 1}):
            y = x.copy()
            y[at] = bad if dtype != np.complex64 else complex(1, bad)
            assert not bool(check(jnp.asarray(y))), (bad, at)
            assert not bool(finite_everywhere(jnp.asarray(y), None)), (bad, at)


@pytest.mark.parametrize("shape", [(782, 32), (20000, 1)])
def test_finite_along_rows(shape):
    """Per row (the solvers' check of chunk starts), against `isfinite`."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    rows = rng.choice(shape[0], size=5, replace=False)
    for row, bad in zip(rows, [*BAD, np.nan, np.inf]):
        x[row, rng.integers(shape[1])] = bad
    got = jax.jit(lambda x: finite_along(x, axis=-1))(jnp.asarray(x))
    np.testing.assert_array_equal(got, np.isfinite(x).all(axis=-1))
    assert not bool(jax.jit(finite_along)(jnp.asarray(x)))
