import os
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.test_util import check_grads

import pscan

from .helpers import (
    KINDS,
    assert_allclose,
    loop_body_copies,
    make_linear_problem,
    random_cotangent,
    reference_linear,
    scan_linear,
)

METHODS = ("sequential", "associative", "chunked")
LENGTHS = (1, 2, 7, 97, 1000)


def _kwargs(method, chunk_size=4):
    return dict(method=method, chunk_size=chunk_size if method == "chunked" else None)


# ---------------------------------------------------------------------------------------
# Values against a float64 loop
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
def test_matches_reference(method, kind, dtype, reverse, with_h0):
    for length in LENGTHS:
        a, b, h0 = make_linear_problem(length, length, (2, 3), kind, dtype)
        h0 = h0 if with_h0 else None
        hs = pscan.linear_recurrence(a, b, h0, reverse=reverse, **_kwargs(method))
        assert hs.shape == b.shape and hs.dtype == b.dtype
        assert_allclose(hs, reference_linear(a, b, h0, reverse))


@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
@pytest.mark.parametrize("method", ("auto", *METHODS))
def test_single_precision(method, dtype):
    a, b, h0 = make_linear_problem(0, 300, (4,), "diagonal", dtype)
    hs = pscan.linear_recurrence(a, b, h0, method=method)
    assert hs.dtype == dtype
    assert_allclose(hs, reference_linear(a, b, h0), dtype)


@pytest.mark.parametrize("kind", ("diagonal", "dense"))
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 64, 2000])
def test_chunk_sizes(chunk_size, reverse, kind):
    for length in (1, 5, 97, 1000):
        a, b, h0 = make_linear_problem(chunk_size + length, length, (3,), kind)
        hs = pscan.linear_recurrence(
            a, b, h0, reverse=reverse, method="chunked", chunk_size=chunk_size
        )
        assert_allclose(hs, reference_linear(a, b, h0, reverse))


@settings(max_examples=12, deadline=None)
@given(
    length=st.integers(1, 300),
    chunk_size=st.integers(1, 40),
    state=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple),
    kind=st.sampled_from(KINDS),
    reverse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_hypothesis(length, chunk_size, state, kind, reverse, seed):
    a, b, h0 = make_linear_problem(seed, length, state, kind)
    hs = pscan.linear_recurrence(
        a, b, h0, reverse=reverse, method="chunked", chunk_size=chunk_size
    )
    assert_allclose(hs, reference_linear(a, b, h0, reverse))


@pytest.mark.parametrize("method", METHODS)
def test_broadcast_coefficients(method):
    """`a` as a scalar, per channel, per step, with a length-1 time axis, and per step
    and channel shared by a batch axis (the chunked method makes the state axes one
    in all but the last case)."""
    _, b, h0 = make_linear_problem(1, 50, (2, 3))
    for a in (
        0.9,
        np.float64(0.5),
        np.full((3,), 0.8),
        np.full((50, 1, 1), 0.7),
        np.linspace(0.1, 0.9, 3),
        np.full((1, 2, 3), 0.6),
        np.linspace(0.2, 0.9, 150).reshape(50, 1, 3),  # T-long, shared by axis 1
    ):
        hs = pscan.linear_recurrence(a, b, h0, **_kwargs(method))
        assert_allclose(hs, reference_linear(np.asarray(a), b, h0))
    # dense, one matrix shared by all steps and by the batch axis
    a = make_linear_problem(2, 1, (3,), "dense")[0]
    hs = pscan.linear_recurrence(a[:, None], b, h0, **_kwargs(method))
    assert_allclose(
        hs, reference_linear(np.broadcast_to(a[:, None], (50, 2, 3, 3)), b, h0)
    )


def test_auto_method():
    a, b, h0 = make_linear_problem(3, 40, (3,))
    assert_allclose(pscan.linear_recurrence(a, b, h0), reference_linear(a, b, h0))
    # `auto` with a chunk size means chunked
    hs = pscan.linear_recurrence(a, b, h0, chunk_size=7)
    assert_allclose(hs, reference_linear(a, b, h0))
    expected = "chunked" if jax.default_backend() == "gpu" else "sequential"
    jaxpr = jax.make_jaxpr(lambda a, b: pscan.linear_recurrence(a, b))(a, b)
    assert f"method={expected}" in str(jaxpr)


@pytest.mark.parametrize(
    "backend, length, expected",
    [
        ("cpu", 5000, "sequential"),
        ("tpu", 2048, "sequential"),
        ("tpu", 2049, "chunked"),
        ("gpu", 40, "chunked"),
    ],
)
def test_auto_method_by_backend_and_length(traced_as, backend, length, expected):
    # the rule as measured (docs/benchmarks.md), traced only: nothing runs on the
    # pretended backend
    traced_as(backend)
    b = jnp.zeros((length, 2))
    jaxpr = jax.make_jaxpr(lambda b: pscan.linear_recurrence(0.5, b))(b)
    assert f"method={expected}" in str(jaxpr)


def test_empty_sequence():
    b = jnp.zeros((0, 3))
    assert pscan.linear_recurrence(jnp.ones((0, 3)), b).shape == (0, 3)


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_propagates(method):
    a, b, h0 = make_linear_problem(4, 30, (2,))
    b[10, 0] = np.nan
    b[12, 1] = np.inf
    hs = np.asarray(pscan.linear_recurrence(a, b, h0, **_kwargs(method)))
    assert np.all(np.isfinite(hs[:10]))
    assert np.all(np.isnan(hs[10:, 0]))
    assert np.all(np.isfinite(hs[:12, 1])) and np.all(~np.isfinite(hs[12:, 1]))


# ---------------------------------------------------------------------------------------
# Composition: jit, vmap, inside scan
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_vmap(method):
    a, b, h0 = make_linear_problem(5, 23, (3,), "dense")
    a2, b2, h02 = (np.stack([x, 0.5 * x]) for x in (a, b, h0))
    f = jax.jit(lambda a, b, h0: pscan.linear_recurrence(a, b, h0, **_kwargs(method)))
    for in_axes in [
        (0, 0, 0),
        (None, 0, None),
        (0, None, None),
        (None, None, 0),
        (2, 1, 0),
    ]:
        args = [
            x if ax is None else np.moveaxis(x2, 0, ax)
            for x, x2, ax in zip((a, b, h0), (a2, b2, h02), in_axes)
        ]
        out = jax.vmap(f, in_axes=in_axes, out_axes=1)(*args)
        for i in range(2):
            picked = [
                x if ax is None else x2[i]
                for x, x2, ax in zip((a, b, h0), (a2, b2, h02), in_axes)
            ]
            assert_allclose(out[:, i], reference_linear(*picked))


@pytest.mark.parametrize("method", METHODS)
def test_inside_scan_and_vmap(method):
    """jax #21637: associative_scan inside scan / vmap once gave wrong values."""
    a, b, h0 = make_linear_problem(6, 37, (2,))
    bs = np.stack([b * (i + 1) for i in range(4)])

    def body(carry, b_i):
        hs = pscan.linear_recurrence(a, b_i, carry, **_kwargs(method, 5))
        return hs[-1], hs

    last, out = lax.scan(body, h0, bs)
    h = h0
    for i in range(4):
        expect = reference_linear(a, bs[i], h)
        assert_allclose(out[i], expect)
        h = expect[-1]
    assert_allclose(last, h)
    nested = jax.vmap(
        jax.vmap(lambda b: pscan.linear_recurrence(a, b, h0, **_kwargs(method)))
    )
    out = nested(np.stack([bs, -bs]))
    assert_allclose(out[1, 2], reference_linear(a, -bs[2], h0))


def test_x64_disabled():
    """With `jax_enable_x64` off, float32 everywhere, and float64 input is downcast."""
    code = (
        "import jax, jax.numpy as jnp, numpy as np, pscan\n"
        "assert not jax.config.jax_enable_x64\n"
        "a = np.full((50, 3), 0.9); b = np.ones((50, 3))\n"
        "for m in ('sequential', 'associative', 'chunked'):\n"
        "    hs = pscan.linear_recurrence(a, b, method=m)\n"
        "    assert hs.dtype == jnp.float32, hs.dtype\n"
        "    g = jax.grad(lambda a: pscan.linear_recurrence(a, b, method=m).sum())(a)\n"
        "    assert g.dtype == jnp.float32\n"
        "    np.testing.assert_allclose(hs[-1], (1 - 0.9**50) / 0.1, rtol=1e-5)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# ---------------------------------------------------------------------------------------
# Derivatives
# ---------------------------------------------------------------------------------------


def _vjp_and_jvp(f, primals, ct, tangents):
    out, vjp = jax.vjp(f, *primals)
    return out, vjp(ct), jax.jvp(f, primals, tangents)[1]


# "scalar" coefficients are broadcast diagonal ones: see test_grad_broadcast_coefficients
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("kind", ("diagonal", "dense"))
@pytest.mark.parametrize("method", METHODS)
def test_vjp_jvp_match_scan_autodiff(method, kind, dtype, reverse):
    a, b, h0 = make_linear_problem(7, 29, (2, 3), kind, dtype)
    primals = tuple(map(jnp.asarray, (a, b, h0)))
    ct = random_cotangent(8, b)
    tangents = tuple(random_cotangent(9 + i, x) for i, x in enumerate(primals))
    ours = jax.jit(_vjp_and_jvp, static_argnums=0)(
        lambda a, b, h0: pscan.linear_recurrence(
            a, b, h0, reverse=reverse, **_kwargs(method)
        ),
        primals,
        ct,
        tangents,
    )
    ref = jax.jit(_vjp_and_jvp, static_argnums=0)(
        lambda a, b, h0: scan_linear(a, b, h0, reverse), primals, ct, tangents
    )
    for x, y in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
        assert_allclose(x, y)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("kind", ("diagonal", "dense"))
@pytest.mark.parametrize("method", METHODS)
def test_check_grads(method, kind, dtype):
    a, b, h0 = make_linear_problem(10, 11, (3,), kind, dtype)
    for reverse in (False, True):
        f = lambda a, b, h0: pscan.linear_recurrence(
            a, b, h0, reverse=reverse, **_kwargs(method, 3)
        )
        check_grads(f, (a, b, h0), order=1, modes=["fwd", "rev"])


@pytest.mark.parametrize("method", METHODS)
def test_second_order(method):
    """Hessian-vector products: the transpose and JVP rules differentiate again."""
    a, b, h0 = make_linear_problem(14, 9, (2,), "diagonal")
    f = lambda a, b, h0: pscan.linear_recurrence(a, b, h0, **_kwargs(method, 2))
    check_grads(f, (a, b, h0), order=2, modes=["rev"])


@pytest.mark.parametrize("method", METHODS)
def test_grad_broadcast_coefficients(method):
    """Gradients of shared coefficients are summed over the axes they are shared by."""
    _, b, h0 = make_linear_problem(11, 20, (2, 3))
    for a in (
        jnp.asarray(0.9),
        jnp.full((3,), 0.8),
        jnp.full((20, 1, 1), 0.7),
        jnp.linspace(0.2, 0.9, 60).reshape(20, 1, 3),
    ):
        g = jax.grad(
            lambda a: jnp.sum(pscan.linear_recurrence(a, b, h0, **_kwargs(method)) ** 2)
        )(a)
        g_ref = jax.grad(
            lambda a: jnp.sum(scan_linear(jnp.broadcast_to(a, b.shape), b, h0) ** 2)
        )(a)
        assert g.shape == a.shape
        assert_allclose(g, g_ref)


@pytest.mark.parametrize("method", METHODS)
def test_vmap_of_grad(method):
    a, b, h0 = make_linear_problem(12, 17, (3,))
    bs = np.stack([b, 2 * b, -b])
    loss = lambda a, b: jnp.sum(
        jnp.sin(pscan.linear_recurrence(a, b, h0, **_kwargs(method)))
    )
    loss_ref = lambda a, b: jnp.sum(jnp.sin(scan_linear(a, b, h0)))
    g = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, 0)))(a, bs)
    g_ref = jax.vmap(jax.grad(loss_ref, argnums=(0, 1)), in_axes=(None, 0))(a, bs)
    for x, y in zip(g, g_ref):
        assert_allclose(x, y)


def test_grad_memory_saves_only_inputs_and_states():
    """The backward pass of the sequential method needs no T-long buffer beyond a, hs."""
    length, d = 4096, 8
    a, b, _ = make_linear_problem(13, length, (d,), dtype=np.float32)

    def temp_bytes(f):
        return (
            jax.jit(jax.grad(f, argnums=(0, 1)))
            .lower(a, b)
            .compile()
            .memory_analysis()
            .temp_size_in_bytes
        )

    ours = temp_bytes(
        lambda a, b: jnp.sum(pscan.linear_recurrence(a, b, method="sequential"))
    )
    plain = temp_bytes(lambda a, b: jnp.sum(scan_linear(a, b, jnp.zeros(d, a.dtype))))
    assert ours <= plain


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_no_buffer_copy_inside_loops(method, shared):
    """jax #10197: a loop body that copies a T-long buffer makes the pass O(T^2).

    Checked on the compiled forward and gradient of a typical loss, with coefficients
    per step and shared by all steps (a regression seen here: 7 s at T = 16384).
    """
    length, d = 1031, 8
    x = jnp.asarray(np.random.default_rng(0).normal(size=length), jnp.float32)
    p = jnp.linspace(-1.0, 2.0, d, dtype=jnp.float32)

    def loss(p, x):
        a = jax.nn.sigmoid(p) * jnp.ones((length if not shared else 1, d), p.dtype)
        hs = pscan.linear_recurrence(a, (1 - a) * x[:, None], **_kwargs(method, 16))
        return jnp.mean((hs - x[:, None]) ** 2)

    for fn in (loss, jax.grad(loss)):
        hlo = jax.jit(fn).lower(p, x).compile().as_text()
        assert loop_body_copies(hlo, length * d) == []


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (
            (np.ones((5, 3)), np.ones((5, 4))),
            {},
            r"`a` with shape \(5, 3\) is not broadcastable to `b` with shape \(5, 4\)",
        ),
        (
            (np.ones(5), np.ones((5, 3))),
            {},
            r"one scalar per step, give `a` shape \(T, 1",
        ),
        ((np.ones((4, 3)), np.ones((5, 3))), {}, r"`a` with shape \(4, 3\)"),
        (
            (np.ones((5, 3)), np.ones((5, 3)), np.ones(4)),
            {},
            r"`h0` must have shape \(3,\).*got \(4,\)",
        ),
        (
            (np.ones((5, 3, 2)), np.ones((5, 3))),
            {},
            r"dense `a` must end in \(3, 3\).*\(5, 3, 2\)",
        ),
        (
            (np.ones((4, 3, 3)), np.ones((5, 3))),
            {},
            r"dense `a` with shape \(4, 3, 3\) does not fit",
        ),
        ((np.ones((5, 1)), np.ones((5,))), {}, r"needs `b` with a state axis"),
        (
            (np.ones((5, 3, 3, 3)), np.ones((5, 3))),
            {},
            r"dense `a` has exactly b.ndim \+ 1 = 3 axes",
        ),
        (
            (np.ones((5, 3)), np.ones((5, 3))),
            {"method": "parallel"},
            r"`method` must be one of",
        ),
        (
            (np.ones((5, 3)), np.ones((5, 3))),
            {"method": "chunked", "chunk_size": 0},
            r"`chunk_size` must be >= 1, got 0",
        ),
        (
            (np.ones((5, 3)), np.ones((5, 3))),
            {"chunk_size": 2.5},
            r"`chunk_size` must be a positive int",
        ),
        (
            (np.ones((5, 3)), np.ones((5, 3))),
            {"method": "sequential", "chunk_size": 4},
            r"only applies to method='chunked'",
        ),
        (
            (np.ones((5, 3), np.int32), np.ones((5, 3), np.int32)),
            {},
            r"the states must be floating or complex, but `a`, `b` have dtypes int32, int32",
        ),
        ((None, np.ones((5, 3))), {}, r"`a` is None, not an array"),
        (
            (np.ones((5, 3)), np.ones((5, 3))),
            {"reverse": 1},
            r"`reverse` must be True or False, got 1",
        ),
        ((np.ones(()), np.ones(())), {}, r"`b` must have a leading time axis"),
        (
            (np.eye(3), np.ones((7, 3))),
            {},
            r"one matrix shared by every step, give `a` shape \(1, 3, 3\)",
        ),
    ],
)
def test_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pscan.linear_recurrence(*args, **kwargs)
    # the same error at trace time under jit
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda *xs: pscan.linear_recurrence(*xs, **kwargs))(*args)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("precision", [32, 64])
def test_real_coefficients_complex_inputs(method, precision):
    """Real `a` with complex `b` (as S5 and LinOSS write it), and complex `a` with real
    `b`: the real arguments are promoted, as in jax.numpy."""
    cplx = np.complex64 if precision == 32 else np.complex128
    a, b, h0 = make_linear_problem(3, 23, (3,), "diagonal", cplx)
    hs = pscan.linear_recurrence(a.real, b, h0, **_kwargs(method, 4))
    assert hs.dtype == cplx
    assert_allclose(hs, reference_linear(a.real, b, h0), cplx)
    hs = pscan.linear_recurrence(a, b.real, h0, **_kwargs(method, 4))
    assert hs.dtype == cplx
    assert_allclose(hs, reference_linear(a, b.real, h0), cplx)


@pytest.mark.parametrize("method", ["chunked", "associative"])
@pytest.mark.parametrize("a, b", [(2.0, 0.0), (-3.0, 0.0), (1.5, 1.0), (1.01, 0.5)])
def test_growing_coefficients_never_nan_where_sequential_is_finite(method, a, b):
    """|a| > 1: composed coefficients overflow to inf although the sequential loop never
    forms them; zeros stay zeros and finite states stay finite (float32, T = 300)."""
    shape = (300, 2)
    A = jnp.full(shape, a, jnp.float32)
    B = jnp.full(shape, b, jnp.float32)
    ref = np.asarray(pscan.linear_recurrence(A, B, method="sequential"))
    hs = np.asarray(pscan.linear_recurrence(A, B, **_kwargs(method, 8)))
    finite = np.isfinite(ref)
    assert finite.any()
    assert not np.isnan(hs[finite]).any()
    np.testing.assert_allclose(hs[finite], ref[finite], rtol=1e-4)
    np.testing.assert_array_equal(hs[~finite], ref[~finite])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("method", METHODS)
def test_gradient_before_a_nonfinite_coefficient_is_finite(method, bad):
    """A loss on the steps before a NaN / inf coefficient does not depend on it: its
    gradient wrt `b` and `h0` is that of the prefix alone, by every method (a zero
    cotangent times the bad coefficient is zero, not NaN, as a zero state is)."""
    a, b, h0 = make_linear_problem(4, 30, (2,))
    a[17, 0] = bad
    a[20, 1] = bad

    def grads(a, b, method):
        loss = lambda b, h0: jnp.sum(
            jnp.sin(pscan.linear_recurrence(a, b, h0, **_kwargs(method))[:12])
        )
        return jax.grad(loss, argnums=(0, 1))(b, h0)

    g_b, g_h0 = grads(a, b, method)
    ref_b, ref_h0 = grads(a[:12], b[:12], "sequential")
    assert_allclose(g_b[:12], ref_b)
    np.testing.assert_array_equal(g_b[12:], 0)
    assert_allclose(g_h0, ref_h0)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("method", ["chunked", "associative"])
def test_infinite_inputs_give_the_loops_states(method, dense, reverse):
    """+-inf among the coefficients (and the inputs): the loop's states exactly where
    they are not finite (inf of the same sign, NaN where the loop has NaN), equal
    where they are. (Combining terms the loop never forms gave NaN, or an inf of the
    other sign, where the loop had +-inf: T = 12, chunk 4, `[1, 1.5, inf, inf, nan..]`.)"""
    rng = np.random.default_rng(7)
    for trial in range(6):
        a = rng.uniform(0.5, 1.5, (13, 2)) * rng.choice([-1.0, 1.0], (13, 2))
        b = rng.normal(size=(13, 2))
        a[rng.integers(13, size=2), [0, 1]] = rng.choice([np.inf, -np.inf], 2)
        if trial % 2:
            b[rng.integers(13), 0] = -np.inf
        h0 = rng.normal(size=2)
        if dense:  # upper triangular: the second channel feeds the first
            a = np.einsum("ti,ij->tij", a, np.eye(2)) + np.array([[0, 0.1], [0, 0]])
        ref = pscan.linear_recurrence(a, b, h0, reverse=reverse, method="sequential")
        ref = np.asarray(ref)
        hs = pscan.linear_recurrence(a, b, h0, reverse=reverse, **_kwargs(method, 4))
        hs = np.asarray(hs)
        assert not np.isfinite(ref).all()
        np.testing.assert_array_equal(np.isnan(hs), np.isnan(ref))
        np.testing.assert_array_equal(hs[np.isinf(ref)], ref[np.isinf(ref)])
        np.testing.assert_allclose(hs, ref, rtol=1e-12)


@pytest.mark.parametrize("method", ["chunked", "associative"])
def test_growing_dense_coefficients_never_nan_where_sequential_is_finite(method):
    """Dense `a = diag(2, 0.5)`, `b = (0, 1)`: the states stay finite, but products of
    composed coefficients overflow and meet zeros (inf * 0 inside the matmul)."""
    a = jnp.broadcast_to(jnp.diag(jnp.array([2.0, 0.5], jnp.float32)), (300, 2, 2))
    b = jnp.broadcast_to(jnp.array([0.0, 1.0], jnp.float32), (300, 2))
    ref = np.asarray(pscan.linear_recurrence(a, b, method="sequential"))
    assert np.isfinite(ref).all()
    hs = np.asarray(pscan.linear_recurrence(a, b, **_kwargs(method, 8)))
    np.testing.assert_allclose(hs, ref, rtol=1e-5)


@pytest.mark.parametrize(
    "a_dtype, b_dtype, h0",
    [
        (np.float32, np.float64, None),
        (np.float64, np.float32, None),
        (np.float64, np.complex64, None),
        (np.complex64, np.float64, None),
        (np.float16, np.complex64, None),
        (np.int32, np.float32, None),
        (np.float32, np.int32, None),
        (np.float64, np.float64, np.array([1, 2, 3])),
        (np.float64, np.float64, np.ones(3, np.complex128)),
    ],
)
def test_dtypes_promote(a_dtype, b_dtype, h0):
    """`a`, `b` and `h0` take one dtype by `jnp.result_type`, alike in every argument:
    the states equal the float64 / complex128 reference in that dtype."""
    a = (0.5 + np.arange(15).reshape(5, 3) % 3 / 8).astype(a_dtype)
    b = (np.arange(15).reshape(5, 3) % 4 - 1).astype(b_dtype)
    dtype = jnp.result_type(*(x for x in (a, b, h0) if x is not None))
    hs = pscan.linear_recurrence(a, b, h0)
    assert hs.dtype == dtype
    ref = reference_linear(
        a.astype(np.complex128), b.astype(np.complex128), None if h0 is None else h0
    )
    tol = 1e-3 if np.finfo(dtype).bits <= 32 else 1e-12
    ref = ref if jnp.iscomplexobj(hs) else ref.real
    np.testing.assert_allclose(np.asarray(hs), ref, rtol=tol, atol=tol)
