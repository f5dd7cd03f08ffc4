"""`pscan.associative_scan`: any associative combine over a pytree, by every method,
against a float64 loop in numpy; derivatives, vmap, and clear errors."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

import pscan

from .helpers import assert_allclose, compiles

METHODS = [("sequential", None), ("associative", None), ("chunked", 4), ("chunked", 1)]


def _combine(earlier, later):
    """Affine maps `x -> M x + v` on a dict pytree, composed (not commutative)."""
    m = jnp.matmul(later["m"], earlier["m"], precision=jax.lax.Precision.HIGHEST)
    v = jnp.einsum("...ij,...j->...i", later["m"], earlier["v"]) + later["v"]
    return {"m": m, "v": v}


def _reference(elems, reverse):
    """The scan by a numpy loop, in float64."""
    m, v = np.asarray(elems["m"], np.float64), np.asarray(elems["v"], np.float64)
    order = range(len(m) - 1, -1, -1) if reverse else range(len(m))
    out_m, out_v = np.empty_like(m), np.empty_like(v)
    acc = None
    for t in order:
        acc = (m[t], v[t]) if acc is None else (m[t] @ acc[0], m[t] @ acc[1] + v[t])
        out_m[t], out_v[t] = acc
    return {"m": out_m, "v": out_v}


def _elems(length, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    m = rng.uniform(-0.7, 0.7, (length, 3, 3)).astype(dtype)
    return {"m": m, "v": rng.normal(size=(length, 3)).astype(dtype)}


def _scan(elems, method, chunk_size, reverse=False):
    return pscan.associative_scan(
        _combine, elems, reverse=reverse, method=method, chunk_size=chunk_size
    )


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("method, chunk_size", METHODS)
@pytest.mark.parametrize("length", [1, 2, 7, 13])
def test_matches_loop(length, method, chunk_size, reverse):
    elems = _elems(length)
    out = jax.jit(_scan, static_argnums=(1, 2, 3))(elems, method, chunk_size, reverse)
    ref = _reference(elems, reverse)
    assert_allclose(out["m"], ref["m"])
    assert_allclose(out["v"], ref["v"])


@settings(max_examples=12, deadline=None)
@given(
    length=st.integers(1, 40),
    chunk_size=st.integers(1, 9),
    reverse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_hypothesis(length, chunk_size, reverse, seed):
    elems = _elems(length, seed)
    out = _scan(elems, "chunked", chunk_size, reverse)
    ref = _reference(elems, reverse)
    assert_allclose(out["v"], ref["v"])


def test_single_precision_and_complex():
    elems = _elems(19, dtype=np.float32)
    for method, chunk_size in METHODS:
        out = _scan(elems, method, chunk_size)
        assert out["v"].dtype == jnp.float32
        assert_allclose(out["v"], _reference(elems, False)["v"], np.float32)
    z = {k: x * (1 + 0.5j) for k, x in _elems(11).items()}
    ref = _scan(z, "sequential", None)
    assert_allclose(_scan(z, "chunked", 3)["v"], ref["v"])


@pytest.mark.parametrize("method, chunk_size", METHODS[1:3])
def test_derivatives(method, chunk_size):
    """Differentiable as the code it runs: against the loop's derivatives, and by
    finite differences."""
    elems = _elems(10, seed=3)
    loss = lambda e, method, c: jnp.sum(jnp.sin(_scan(e, method, c)["v"]))
    g = jax.jit(jax.grad(loss), static_argnums=(1, 2))(elems, method, chunk_size)
    ref = jax.jit(jax.grad(loss), static_argnums=(1, 2))(elems, "sequential", None)
    assert_allclose(g["m"], ref["m"])
    assert_allclose(g["v"], ref["v"])
    f = jax.jit(lambda e: _scan(e, method, chunk_size))
    check_grads(f, (elems,), order=1, modes=("fwd", "rev"))


def test_vmap():
    elems = _elems(4 * 9)
    batched = {k: x.reshape(4, 9, *x.shape[1:]) for k, x in elems.items()}
    out = jax.vmap(lambda e: _scan(e, "chunked", 2))(batched)
    for i in range(4):
        ref = _reference({k: x[i] for k, x in batched.items()}, False)
        assert_allclose(out["v"][i], ref["v"])


def test_noncommutative_combine_order():
    """`combine(earlier, later)`: a combine that keeps the earlier element gives the
    first step everywhere, and the last step with `reverse`."""
    first = lambda earlier, later: earlier
    xs = jnp.arange(7.0)
    for method, chunk_size in METHODS:
        fwd = pscan.associative_scan(first, xs, method=method, chunk_size=chunk_size)
        bwd = pscan.associative_scan(
            first, xs, reverse=True, method=method, chunk_size=chunk_size
        )
        np.testing.assert_array_equal(fwd, np.zeros(7))
        np.testing.assert_array_equal(bwd, np.full(7, 6.0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="parallel"), "`method` must be one of"),
        (dict(method="associative", chunk_size=4), "only applies to method='chunked'"),
        (dict(method="chunked", chunk_size=0), "`chunk_size` must be a positive int"),
        (dict(elems=(np.ones(3), np.ones(4))), r"common leading \(time\) axis"),
        (dict(elems=np.float32(1.0)), r"common leading \(time\) axis"),
        (dict(reverse="yes"), "`reverse` must be True or False, got 'yes'"),
    ],
)
def test_bad_input(kwargs, match):
    kwargs = {"elems": np.ones(3), **kwargs}
    with pytest.raises(ValueError, match=match):
        pscan.associative_scan(jnp.add, **kwargs)


def test_eager_calls_compile_once():
    """Called eagerly with the same combine and shapes, a scan is compiled once."""
    x = jax.random.normal(jax.random.PRNGKey(0), (50, 3))
    scan = lambda x: pscan.associative_scan(jnp.maximum, x, method="chunked")
    scan(x)
    y = x + 1.0
    with compiles() as names:
        out = scan(y)
    assert names == []
    assert_allclose(out, np.maximum.accumulate(np.asarray(y), axis=0))


_SCALE = 1.0


def _scaled_max(a, b):  # reads a global
    return jnp.maximum(a, b) * _SCALE


def test_eager_function_combine_reads_globals_afresh(monkeypatch):
    """A plain-function `combine` is traced at every eager call: a global it reads,
    changed between calls, changes the answer."""
    x = jnp.arange(5.0)
    before = pscan.associative_scan(_scaled_max, x, method="sequential")
    assert_allclose(before, np.arange(5.0))
    monkeypatch.setattr(sys.modules[__name__], "_SCALE", 2.0)
    after = pscan.associative_scan(_scaled_max, x, method="sequential")
    assert_allclose(after, [0.0, 2.0, 4.0, 8.0, 16.0])
