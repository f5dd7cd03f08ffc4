"""Packed sequences (`resets`) and right padding (`length`) for every linear method and
every solver, against running each segment (or the real prefix) separately in float64.

Layouts are traced values: each test compiles once per method or solver and hypothesis
draws many layouts through the one program."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pscan

from .helpers import (
    ElmanCell,
    assert_allclose,
    make_linear_problem,
    reference_linear,
    scan_cell,
    tree_allclose,
)

TIGHT = dict(rtol=1e-13, atol=1e-13)
CLOSE = dict(rtol=1e-10, atol=1e-10)
T = 29  # a prime: no chunk size divides it
CHUNK = 4
EXAMPLES = settings(max_examples=8, deadline=None)


def layouts(length=T):
    """Segment starts: a reset at step 0 or not, segments of length 1, resets at chunk
    boundaries and inside chunks."""
    steps = st.lists(st.integers(0, length - 1), max_size=8)
    return steps.map(lambda ts: np.isin(np.arange(length), ts))


def segments(resets):
    """`[(start, end), ...]` covering `0..T` as `resets` splits it."""
    starts = sorted({0, *np.flatnonzero(resets).tolist()})
    return list(zip(starts, starts[1:] + [len(resets)]))


def reference_linear_segments(a, b, h0, resets, reverse=False):
    """Every segment run separately by the float64 loop."""
    a = np.broadcast_to(a, (b.shape[0], *np.shape(a)[1:]))
    out = np.zeros(b.shape, np.result_type(a, b))
    for s, e in segments(resets):
        out[s:e] = reference_linear(a[s:e], b[s:e], h0, reverse=reverse)
    return out


def scan_linear_resets(a, b, h0, resets, reverse=False):
    """The recurrence with resets by a plain `lax.scan` (JAX's autodiff of it is the
    reference gradient): a step that starts a segment (that ends one, backward) reads
    `h0`."""
    dense = a.ndim == b.ndim + 1
    restart = jnp.concatenate([resets[1:], jnp.zeros(1, bool)]) if reverse else resets

    def step(h, arb):
        a_t, r, b_t = arb
        h = jnp.where(r, h0, h)
        h = (a_t @ h[..., None])[..., 0] + b_t if dense else a_t * h + b_t
        return h, h

    a = jnp.broadcast_to(a, (b.shape[0], *a.shape[1:]))
    return lax.scan(step, h0, (a, restart, b), reverse=reverse)[1]


LINEAR = [
    ("sequential", None),
    ("associative", None),
    ("chunked", CHUNK),
    ("chunked", 1),
]


@pytest.mark.parametrize("kind", ["diagonal", "scalar", "dense"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("method, chunk_size", LINEAR)
def test_linear_resets_are_separate_segments(method, chunk_size, reverse, kind):
    a, b, h0 = make_linear_problem(0, T, state=(2, 3), kind=kind)
    solve = jax.jit(
        lambda a, b, h0, r: pscan.linear_recurrence(
            a, b, h0, resets=r, reverse=reverse, method=method, chunk_size=chunk_size
        )
    )
    ct = np.random.default_rng(1).normal(size=b.shape)
    loss = lambda f: lambda a, b, h0, r: jnp.sum(ct * f(a, b, h0, r))
    grad = jax.jit(jax.grad(loss(solve), argnums=(0, 1, 2)))
    ref_grad = jax.jit(
        jax.grad(
            loss(lambda *args: scan_linear_resets(*args, reverse=reverse)),
            argnums=(0, 1, 2),
        )
    )

    @EXAMPLES
    @given(layouts())
    def check(resets):
        ref = reference_linear_segments(a, b, h0, resets, reverse)
        np.testing.assert_allclose(solve(a, b, h0, resets), ref, **CLOSE)
        assert tree_allclose(
            grad(a, b, h0, resets), ref_grad(a, b, h0, resets), **CLOSE
        )

    check()


@pytest.mark.parametrize("method, chunk_size", LINEAR[1:3])
def test_linear_resets_forward_mode_and_vmap(method, chunk_size):
    a, b, h0 = make_linear_problem(2, T, state=(3,))
    resets = np.isin(np.arange(T), [0, 4, 5, 13, 28])
    solve = lambda a, b, h0, r: pscan.linear_recurrence(
        a, b, h0, resets=r, method=method, chunk_size=chunk_size
    )
    tangents = tuple(np.ones_like(x) for x in (a, b, h0))
    out, tangent = jax.jvp(lambda *p: solve(*p, resets), (a, b, h0), tangents)
    ref, ref_tangent = jax.jvp(
        lambda *p: scan_linear_resets(*p, resets), (a, b, h0), tangents
    )
    np.testing.assert_allclose(out, ref, **CLOSE)
    np.testing.assert_allclose(tangent, ref_tangent, **CLOSE)
    batch = np.stack([resets, ~resets, np.zeros(T, bool)])
    hs = jax.vmap(solve, in_axes=(None, None, None, 0))(a, b, h0, batch)
    for r, h in zip(batch, hs):
        np.testing.assert_allclose(h, reference_linear_segments(a, b, h0, r), **CLOSE)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("method, chunk_size", LINEAR[:3])
def test_linear_length(method, chunk_size, reverse):
    """Steps at and after `length` are the identity: the prefix is exact, the state
    after step `length - 1` is carried to the end (backward: `h0` is carried to step
    `length - 1`), for lengths 0 to T, under vmap (one length per sequence)."""
    a, b, h0 = make_linear_problem(3, T, state=(3,))
    solve = lambda n: pscan.linear_recurrence(
        a, b, h0, length=n, reverse=reverse, method=method, chunk_size=chunk_size
    )
    lengths = np.array([0, 1, 2, 5, 17, T - 1, T, T + 3])
    hs = jax.jit(jax.vmap(solve))(lengths)
    for n, h in zip(lengths, hs):
        m = min(n, T)
        if m:
            ref = reference_linear(a[:m], b[:m], h0, reverse=reverse)
            np.testing.assert_allclose(h[:m], ref, **CLOSE)
        held = h0 if reverse or m == 0 else h[m - 1]
        np.testing.assert_allclose(h[m:], np.broadcast_to(held, h[m:].shape), **CLOSE)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("kind", ["diagonal", "dense"])
def test_linear_nan_never_crosses_a_reset(kind, reverse):
    """A NaN in one segment of a packed batch leaves every other segment exact, with
    every method, elementwise or dense `a` (a dense reset once made every later
    segment NaN); a NaN tangent or cotangent stays in its segment too."""
    a, b, h0 = make_linear_problem(4, T, state=(3,), kind=kind)
    resets = np.isin(np.arange(T), [0, 6, 12, 20])
    nan_b = b.copy()
    nan_b[9, 1] = np.nan
    ref = reference_linear_segments(a, nan_b, h0, resets, reverse=reverse)
    # the reference derivatives: NaN in the derivative exactly where the segment's
    # loop reads the NaN (JAX's own differentiation of the plain scan)
    scan = lambda b: scan_linear_resets(
        jnp.asarray(a), b, jnp.asarray(h0), resets, reverse
    )
    tangent = np.ones_like(b)
    tangent[9, 1] = np.nan
    ref_jvp = jax.jvp(scan, (b,), (tangent,))[1]
    ref_vjp = jax.vjp(scan, b)[1](tangent)[0]
    assert np.isnan(ref).any() and np.isfinite(ref).any()
    for method, chunk_size in LINEAR:
        run = lambda b: pscan.linear_recurrence(
            a,
            b,
            h0,
            resets=resets,
            method=method,
            chunk_size=chunk_size,
            reverse=reverse,
        )
        hs = run(nan_b)
        np.testing.assert_array_equal(np.isnan(hs), np.isnan(ref))
        np.testing.assert_allclose(hs, ref, **CLOSE)
        for got, want in [
            (jax.jvp(run, (b,), (tangent,))[1], ref_jvp),
            (jax.vjp(run, b)[1](tangent)[0], ref_vjp),
        ]:
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_allclose(got, want, **CLOSE)


def test_linear_bad_masks():
    a, b, h0 = make_linear_problem(0, 5)
    with pytest.raises(
        ValueError, match=r"`resets` must be a boolean array of shape \(5,\)"
    ):
        pscan.linear_recurrence(a, b, resets=np.zeros(4, bool))
    with pytest.raises(ValueError, match="`resets` must be a boolean.*int64"):
        pscan.linear_recurrence(a, b, resets=np.zeros(5, int))
    with pytest.raises(ValueError, match="`length` must be an integer scalar"):
        pscan.linear_recurrence(a, b, length=np.array([3]))
    with pytest.raises(ValueError, match="`length` must be an integer scalar"):
        pscan.linear_recurrence(a, b, length=2.5)


# --------------------------------------------------------------------------------------
# Nonlinear cells
# --------------------------------------------------------------------------------------

SOLVERS = {
    "sequential": pscan.Sequential(),
    "checkpointed": pscan.Sequential(checkpoint=5),
    "picard": pscan.Picard(chunk_size=CHUNK, **TIGHT),
    "deer": pscan.Newton(**TIGHT),
    "quasi-deer": pscan.Newton(jacobian="diagonal", **TIGHT),
    "shooting": pscan.Newton(chunk_size=CHUNK, **TIGHT),
    "quasi-shooting": pscan.Newton(chunk_size=CHUNK, jacobian="diagonal", **TIGHT),
    "fallback": pscan.Newton(
        chunk_size=CHUNK, max_iters=1, fallback="sequential", **TIGHT
    ),
    "elk": pscan.ELK(**TIGHT),
    "elk-chunked": pscan.ELK(chunk_size=CHUNK, **TIGHT),
}


def make_cell(n_in=2, n_hidden=3):
    cell = ElmanCell(n_in, n_hidden, key=jax.random.PRNGKey(0), scale=1.5)
    xs = jax.random.normal(jax.random.PRNGKey(1), (T, n_in))
    return cell, xs, jnp.array([0.3, -0.2, 0.5])


def scan_cell_masked(cell, xs, h0, resets=None, length=None, reverse=False):
    """The reference `lax.scan`: a reset step reads `h0`, a padded step is skipped."""
    n = xs.shape[0]
    restart = jnp.zeros(n, bool) if resets is None else resets
    if reverse:
        restart = jnp.concatenate([restart[1:], jnp.zeros(1, bool)])
    valid = jnp.ones(n, bool) if length is None else jnp.arange(n) < length

    def step(h, xrv):
        x, r, v = xrv
        h_next = cell(x, jnp.where(r, h0, h))
        h = jnp.where(v, h_next, h)
        return h, h

    return lax.scan(step, h0, (xs, restart, valid), reverse=reverse)[1]


@pytest.mark.parametrize("solver", SOLVERS.values(), ids=SOLVERS.keys())
def test_resets_are_separate_segments(solver):
    """States, gradients (wrt the cell, xs and h0) and forward-mode tangents equal
    those of every segment run separately (and of autodiff through a `lax.scan`)."""
    cell, xs, h0 = make_cell()

    def states(cell, xs, h0, r):
        return pscan.recurrence(cell, xs, h0, solver=solver, resets=r).hs

    ct = jax.random.normal(jax.random.PRNGKey(2), (T, 3))
    loss = lambda f: lambda *args: jnp.sum(ct * f(*args))
    grad = eqx.filter_jit(jax.grad(loss(states), argnums=(0, 1, 2)))
    ref_grad = eqx.filter_jit(jax.grad(loss(scan_cell_masked), argnums=(0, 1, 2)))
    solve = eqx.filter_jit(states)
    tangents = jax.tree_util.tree_map(jnp.ones_like, (cell, xs, h0))

    @eqx.filter_jit
    def jvp(r):
        f = lambda *p: states(*p, r)
        return jax.jvp(f, (cell, xs, h0), tangents)[1]

    @eqx.filter_jit
    def ref_jvp(r):
        f = lambda *p: scan_cell_masked(*p, r)
        return jax.jvp(f, (cell, xs, h0), tangents)[1]

    @EXAMPLES
    @given(layouts())
    def check(resets):
        ref = np.zeros((T, 3))
        for s, e in segments(resets):
            ref[s:e] = scan_cell(cell, xs[s:e], h0)
        np.testing.assert_allclose(solve(cell, xs, h0, resets), ref, **CLOSE)
        assert tree_allclose(
            grad(cell, xs, h0, resets), ref_grad(cell, xs, h0, resets), **CLOSE
        )
        np.testing.assert_allclose(jvp(resets), ref_jvp(resets), **CLOSE)

    check()


@pytest.mark.parametrize(
    "solver", [SOLVERS[k] for k in ("sequential", "picard", "shooting", "elk-chunked")]
)
def test_reverse_and_length(solver):
    """`reverse=True` with resets runs each segment backward from its last step; with
    `length` only the real prefix, from step `length - 1`; forward, the last state is
    held. Under `jax.vmap` with one `length` per sequence."""
    cell, xs, h0 = make_cell()
    resets = np.isin(np.arange(T), [0, 3, 4, 16, 20])
    hs = pscan.recurrence(cell, xs, h0, solver=solver, resets=resets, reverse=True).hs
    ref = np.zeros((T, 3))
    for s, e in segments(resets):
        ref[s:e] = jnp.flip(scan_cell(cell, jnp.flip(xs[s:e], 0), h0), 0)
    np.testing.assert_allclose(hs, ref, **CLOSE)

    lengths = jnp.array([1, 2, 7, 16, T])
    for reverse in (False, True):
        run = lambda n: (
            pscan.recurrence(
                cell, xs, h0, solver=solver, length=n, resets=resets, reverse=reverse
            ).hs
        )
        out = eqx.filter_jit(jax.vmap(run))(lengths)
        for n, h in zip(lengths, out):
            want = scan_cell_masked(cell, xs, h0, resets, n, reverse)
            np.testing.assert_allclose(h, want, **CLOSE)
            m = int(n)
            part = scan_cell_masked(cell, xs[:m], h0, resets[:m], None, reverse)
            np.testing.assert_allclose(h[:m], part, **CLOSE)


def test_reverse_with_axis_name_refused():
    cell, xs, h0 = make_cell()
    with pytest.raises(ValueError, match="`reverse=True` cannot be combined"):
        pscan.recurrence(
            cell, xs, h0, solver=pscan.Picard(axis_name="time"), reverse=True
        )


@pytest.mark.parametrize(
    "solver",
    [pscan.Picard(chunk_size=CHUNK), pscan.Newton(chunk_size=CHUNK)],
    ids=["picard", "shooting"],
)
def test_reset_at_every_chunk_start_costs_no_iteration(solver):
    """Chunks that each start at a reset are independent: the solve is exact after
    one sweep and confirmed by a second, however many chunks there are."""
    cell, _, h0 = make_cell()
    xs = jax.random.normal(jax.random.PRNGKey(3), (16 * CHUNK, 2))
    resets = np.arange(16 * CHUNK) % CHUNK == 0
    unbroken = pscan.recurrence(cell, xs, h0, solver=solver)
    sol = pscan.recurrence(cell, xs, h0, solver=solver, resets=resets)
    assert int(sol.stats["num_iterations"]) == 2
    assert int(unbroken.stats["num_iterations"]) > 2
    ref = jax.vmap(lambda x: scan_cell(cell, x, h0))(xs.reshape(16, CHUNK, 2))
    np.testing.assert_allclose(sol.hs, ref.reshape(-1, 3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("solver", SOLVERS.values(), ids=SOLVERS.keys())
def test_nan_in_one_segment(solver):
    """A NaN input in one segment of a packed sequence: the sequential loop's states
    (the other segments exact, that one NaN from the bad step to its end), flagged
    `nonfinite`, no error with `throw=True`."""
    cell, xs, h0 = make_cell()
    xs = xs.at[9, 0].set(jnp.nan)
    resets = np.isin(np.arange(T), [0, 6, 13, 14, 22])
    ref = scan_cell_masked(cell, xs, h0, resets)
    sol = pscan.recurrence(cell, xs, h0, solver=solver, resets=resets)
    assert sol.result == pscan.RESULTS.nonfinite
    np.testing.assert_array_equal(np.isnan(sol.hs), np.isnan(ref))
    np.testing.assert_allclose(sol.hs, ref, **CLOSE)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    "name", ["picard", "deer", "shooting", "quasi-shooting", "elk"]
)
def test_nan_derivative_never_crosses_a_reset(name, reverse):
    """An infinite input saturates the cell (finite states), and a NaN tangent at one
    step of one segment stays in that segment, as in the loop (the exact-Jacobian
    solvers once carried it into every later segment: a reset's zero Jacobian times
    NaN in their tangent's dense solve). So does a NaN cotangent with the iterated
    adjoints; the exact ones (`Newton`, `ELK`) make every cotangent NaN once the
    adjoint has a NaN, as documented (a parameter's gradient is NaN with a loop too)."""
    cell, xs, h0 = make_cell()
    xs = xs.at[11, 0].set(jnp.inf)
    resets = np.isin(np.arange(T), [0, 6, 13, 14, 22])
    tangent = jnp.ones_like(xs).at[11, 0].set(jnp.nan)
    cotangent = jnp.ones((T, 3)).at[16, 0].set(jnp.nan)
    run = lambda x: (
        pscan.recurrence(
            cell, x, h0, solver=SOLVERS[name], resets=resets, reverse=reverse
        ).hs
    )
    ref = lambda x: scan_cell_masked(cell, x, h0, resets, reverse=reverse)
    jvp = lambda f: jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])(xs, tangent)
    vjp = lambda f: jax.jit(lambda x, c: jax.vjp(f, x)[1](c)[0])(xs, cotangent)
    for got, want in [(vjp(run), vjp(ref)), (jvp(run), jvp(ref))]:
        if name in ("deer", "shooting", "elk") and got.shape == xs.shape:
            assert np.all(np.isnan(got))  # the cotangents
            continue
        assert np.isnan(want).any() and np.isfinite(want).any()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, **CLOSE)


@pytest.mark.parametrize("name", ["sequential", "shooting", "elk-chunked"])
def test_nan_padding_leaves_gradients_finite(name):
    """Padding past `length` filled with NaN (a common marker of missing samples) is
    never read: the states, and every gradient, equal those of zero padding (the
    cell's derivatives at a padded step are discarded; NaN ones made all NaN)."""
    cell, xs, h0 = make_cell()
    n = 17
    nan_xs = xs.at[n:].set(jnp.nan)
    zero_xs = xs.at[n:].set(0.0)
    loss = lambda c, x, h: jnp.sum(
        pscan.recurrence(c, x, h, solver=SOLVERS[name], length=n).hs ** 2
    )
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    got, want = grad(cell, nan_xs, h0), grad(cell, zero_xs, h0)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(got))
    assert tree_allclose(got, want, **CLOSE)


def test_nonlinear_bad_masks():
    cell, xs, h0 = make_cell()
    with pytest.raises(
        ValueError, match=r"pscan.recurrence: `resets` must be a boolean"
    ):
        pscan.recurrence(cell, xs, h0, resets=np.ones(T + 1, bool))
    with pytest.raises(ValueError, match=r"pscan.recurrence: `length` must be"):
        pscan.recurrence(cell, xs, h0, length=jnp.ones(2, int))


@pytest.mark.parametrize("reverse", [False, True])
def test_length_out_of_range(reverse):
    """As documented: a `length` of T or more leaves every step real, 0 or less none
    (every state is h0), for the linear recurrence and the solvers alike."""
    cell = eqx.nn.GRUCell(1, 3, key=jax.random.PRNGKey(0))
    xs = jax.random.normal(jax.random.PRNGKey(1), (9, 1))
    h0 = jnp.array([0.1, -0.2, 0.3])
    for solver in (pscan.Sequential(), pscan.Newton(chunk_size=4)):
        run = lambda n: (
            pscan.recurrence(cell, xs, h0, solver=solver, reverse=reverse, length=n).hs
        )
        assert_allclose(run(20), run(None))
        for n in (0, -3):
            assert_allclose(run(n), jnp.broadcast_to(h0, (9, 3)))
    b = jax.random.normal(jax.random.PRNGKey(2), (9, 2))
    lin = lambda n: pscan.linear_recurrence(0.5, b, reverse=reverse, length=n)
    assert_allclose(lin(50), lin(None))
    assert_allclose(lin(0), jnp.zeros((9, 2)))
