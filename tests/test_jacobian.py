"""The chunk-Jacobian operators: built by forward mode in groups of columns, equal to
`jax.jacfwd`; products, transposes and row masks as the matrices they stand for."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import pscan
from pscan._solvers import _jacobian as jacobian_module
from pscan._solvers._jacobian import _dense, _diagonal

from .helpers import assert_allclose

W = jax.random.normal(jax.random.PRNGKey(0), (5, 5))


def f(s, x=0.0):
    return jnp.tanh(W @ s + x) * s[::-1]


@pytest.mark.parametrize("stacked", [False, True], ids=["in place", "stacked"])
@pytest.mark.parametrize("width", [1, 2, 3, 5, 8])
def test_jacobians_in_groups_of_columns(width, stacked):
    """By groups of forward-mode products (the last group overlapping the one before
    when `width` does not divide `d = 5`): the diagonal and the dense matrix (and its
    transpose, and a pytree output's) equal `jax.jacfwd`'s; `f`'s value comes along.
    The dense groups either written in place or stacked and joined (one-step chunks
    on a TPU), which agree bit for bit, vectorised over chunks too."""
    if stacked:  # against in place (once per width)
        starts = jax.random.normal(jax.random.PRNGKey(1), (3, 5))
        for transposed in (False, True):
            build = lambda s, way: _dense(f, s, transposed, least=width, stacked=way)
            ways = [jax.vmap(lambda s: build(s, way))(starts) for way in (False, True)]
            assert all(map(jnp.array_equal, *ways))
    s = jnp.linspace(-1.0, 1.0, 5)
    jac = jax.jacfwd(f)(s)
    diagonal, value = _diagonal(f, s, width)
    assert_allclose(diagonal, jnp.diag(jac))
    assert_allclose(value, f(s))
    dense, value = _dense(f, s, False, least=width, stacked=stacked)
    assert_allclose(dense, jac)
    assert_allclose(value, f(s))
    pair = lambda s: (f(s), jnp.sum(f(s) ** 2))
    (dense_t, grad), (value, extra) = _dense(pair, s, True, 8, width, stacked)
    assert_allclose(dense_t, jac.T)
    assert_allclose(grad, jax.grad(lambda s: pair(s)[1])(s))
    assert_allclose(extra, pair(s)[1])


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
@pytest.mark.parametrize("chunk", [1, 4, 8, 40])
def test_operators(chunk, backend, traced_as):
    """`linearise` over K chunks (each `x_k` a chunk of `chunk` inputs, summed here),
    then `mv`, `transpose`, `rows`, `scale`, `finite` and `coefficients`; also as
    traced for a TPU (which stacks one-step chunks' column groups)."""
    traced_as(backend)
    k = 3
    starts = jax.random.normal(jax.random.PRNGKey(1), (k, 5))
    xs = jax.random.normal(jax.random.PRNGKey(2), (k, chunk, 5))
    end = lambda s, x: f(s, jnp.sum(x, axis=0))
    jacs = jnp.stack([jax.jacfwd(end)(s, x) for s, x in zip(starts, xs)])
    v = jax.random.normal(jax.random.PRNGKey(3), (k, 5))
    keep = jnp.array([True, False, True])

    dense = pscan.DenseJacobian.linearise(end, starts, xs)
    assert pscan.DenseJacobian.exact and not pscan.DiagonalJacobian.exact
    assert_allclose(dense.matrix, jacs)
    assert_allclose(dense.mv(v), jnp.einsum("kij,kj->ki", jacs, v))
    assert_allclose(dense.transpose().matrix, jnp.swapaxes(jacs, 1, 2))
    t = pscan.DenseJacobian.linearise(end, starts, xs, transposed=True)
    assert_allclose(t.matrix, jnp.swapaxes(jacs, 1, 2))
    assert_allclose(dense.rows(keep).mv(v)[1], 0 * v[1])
    assert_allclose(dense.scale(0.5).coefficients(), 0.5 * jacs)
    assert bool(jnp.all(dense.finite()))

    diagonal = pscan.DiagonalJacobian.linearise(end, starts, xs)
    diag = jnp.diagonal(jacs, axis1=1, axis2=2)
    assert_allclose(diagonal.diagonal, diag)
    assert_allclose(diagonal.mv(v), diag * v)
    assert diagonal.transpose() is diagonal
    assert_allclose(diagonal.rows(keep).coefficients()[1], 0 * diag[1])
    bad = pscan.DiagonalJacobian(diag.at[2, 0].set(jnp.nan))
    assert [bool(x) for x in bad.finite()] == [True, True, False]

    # the values of the forward-mode pass: the chunk ends, without another run
    ends = jax.vmap(end)(starts, xs)
    for structure in (pscan.DenseJacobian, pscan.DiagonalJacobian):
        operator, values = structure.linearise(end, starts, xs, value=True)
        assert isinstance(operator, structure)
        assert_allclose(values, ends)
    pair = lambda s, x: (end(s, x), jnp.sum(s**2))
    t, grad, (values, extra) = pscan.DenseJacobian.linearise(
        pair, starts, xs, transposed=True, value=True
    )
    assert_allclose(t.matrix, jnp.swapaxes(jacs, 1, 2))
    assert_allclose(grad, 2 * starts)
    assert_allclose(values, ends)
    assert_allclose(extra, jnp.sum(starts**2, axis=-1))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_one_more_chunk_against_cache_aliasing(backend, monkeypatch, traced_as):
    """On CPU, when the K chunks' rows of state take a multiple of `_ALIASING_BYTES`
    (2 KiB: rows that far apart share cache sets, and the lockstep pass over the
    chunks ran 1.5-3x slower), the forward-mode pass runs one more chunk and drops its
    outputs: the same operators and values. Elsewhere, and for one-step chunks, not."""
    traced_as(backend)
    k, d = 8, 5
    starts = jax.random.normal(jax.random.PRNGKey(1), (k, d))
    xs = jax.random.normal(jax.random.PRNGKey(2), (k, 8, d))
    end = lambda s, x: f(s, jnp.sum(x, axis=0))
    pair = lambda s, x: (end(s, x), jnp.sum(s**2))

    def build(xs):
        return [
            pscan.DenseJacobian.linearise(end, starts, xs, value=True),
            pscan.DenseJacobian.linearise(
                pair, starts, xs, transposed=True, value=True
            ),
            pscan.DiagonalJacobian.linearise(end, starts, xs, value=True),
        ]

    joins = lambda xs: str(jax.make_jaxpr(lambda x: build(x))(xs)).count("concatenate")
    before, before_one_step = joins(xs), joins(xs[:, :1])
    want = build(xs)
    monkeypatch.setattr(jacobian_module, "_ALIASING_BYTES", k * d * 8)
    # the starts and the inputs, in each of the three passes (chunks of 8 steps)
    assert joins(xs) == before + (6 if backend == "cpu" else 0)
    assert joins(xs[:, :1]) == before_one_step  # one-step chunks
    got = build(xs)
    leaves = jax.tree_util.tree_leaves
    assert len(leaves(got)) == len(leaves(want)) == 8
    for a, b in zip(leaves(got), leaves(want)):
        assert a.shape == b.shape
        assert_allclose(a, b)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_groups_of_one_more_chunk_against_cache_aliasing(
    backend, monkeypatch, traced_as
):
    """The diagonal Jacobians of chunks of 2-7 steps are built over groups of chunks
    in turn (`32 / C` groups): on CPU, where a group's rows of state would take a
    multiple of `_ALIASING_BYTES` (and one more row would not), the groups take one
    more chunk each (the last overlapping the one before): the same diagonals and
    values, for any number of chunks."""
    traced_as(backend)
    d, c = 5, 4  # 8 groups
    end = lambda s, x: f(s, jnp.sum(x, axis=0))
    slices = lambda k, xs: str(
        jax.make_jaxpr(lambda x: pscan.DiagonalJacobian.linearise(end, x[0], x[1]))(
            (jnp.zeros((k, d)), xs)
        )
    )
    for k in (32, 37):
        starts = jax.random.normal(jax.random.PRNGKey(1), (k, d))
        xs = jax.random.normal(jax.random.PRNGKey(2), (k, c, d))
        want = pscan.DiagonalJacobian.linearise(end, starts, xs, value=True)
        size = -(-k // 8)
        with monkeypatch.context() as patch:
            patch.setattr(jacobian_module, "_ALIASING_BYTES", size * d * 8)
            more = backend == "cpu"
            assert f"slice_sizes=({size + more}, {d})" in slices(k, xs)
            got = pscan.DiagonalJacobian.linearise(end, starts, xs, value=True)
        assert_allclose(got[0].diagonal, want[0].diagonal)
        assert_allclose(got[1], want[1])


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_diagonal_of_longer_chunks_in_groups_on_a_tpu(backend, traced_as):
    """On a TPU the diagonals of chunks of 8 or more steps are built as those of
    shorter chunks, 32 products at once over `32 / C` groups of chunks (a loop of
    `max(32, C)` steps, not `8 d`); on CPU a few products at once over all chunks.
    The same diagonals either way."""
    d, c, k = 5, 16, 10
    starts = jax.random.normal(jax.random.PRNGKey(1), (k, d))
    xs = jax.random.normal(jax.random.PRNGKey(2), (k, c, d))
    end = lambda s, x: f(s, jnp.sum(x, axis=0))
    want = pscan.DiagonalJacobian.linearise(end, starts, xs, value=True)
    traced_as(backend)
    jaxpr = str(
        jax.make_jaxpr(lambda s: pscan.DiagonalJacobian.linearise(end, s, xs))(starts)
    )
    # two groups of 5 chunks on a TPU
    assert ("slice_sizes=(5, 5)" in jaxpr) == (backend == "tpu")
    got = pscan.DiagonalJacobian.linearise(end, starts, xs, value=True)
    assert_allclose(got[0].diagonal, want[0].diagonal)
    assert_allclose(got[1], want[1])


def test_one_step_chunks_in_groups_without_a_copy():
    """Chunks of one step (quasi-DEER's) are linearised in 8 groups of rows written in
    place: when 8 does not divide T the last group overlaps the one before, instead
    of a remainder run on its own and concatenated (`lax.map`'s way), which copied
    every output: quasi-DEER's forward at T = 4001 held 11.8x the states' bytes of
    XLA temp against 10.1x at T = 4000, now 10.0x at both."""
    cell = eqx.nn.GRUCell(1, 32, key=jax.random.PRNGKey(0))
    solver = pscan.Newton(jacobian="diagonal")

    def temp(length):
        xs = jnp.ones((length, 1), jnp.float32)
        f = lambda c: pscan.recurrence(c, xs, jnp.zeros(32), solver=solver).hs
        compiled = jax.jit(f).lower(cell).compile()
        return compiled.memory_analysis().temp_size_in_bytes / length

    assert temp(4001) < 1.05 * temp(4000)


@pytest.mark.parametrize("jacobian", ["dense", "diagonal"])
def test_inputs_of_size_zero(jacobian):
    """A cell without inputs (`xs` of shape `(T, 0)`): the groups of one-step chunks
    take their outputs' type from the inputs that have entries."""
    cell = lambda x, h: jnp.tanh(0.5 * h)
    xs, h0 = jnp.zeros((10, 0)), 0.5 * jnp.ones(3)
    want = pscan.recurrence(cell, xs, h0).hs
    tol = dict(rtol=1e-12, atol=1e-12, jacobian=jacobian)
    for solver in (pscan.Newton(**tol), pscan.ELK(**tol)):
        assert_allclose(pscan.recurrence(cell, xs, h0, solver=solver).hs, want)
