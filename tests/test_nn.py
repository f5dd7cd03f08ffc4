"""`pscan.nn`: the Recurrence layer and the cells, against hand-written `lax.scan`."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

import pscan
import pscan.nn as nn

from .helpers import assert_allclose, to_dtype, tree_allclose

IN, HIDDEN = 3, 4
CELLS = {
    "ElmanCell": lambda key: nn.ElmanCell(IN, HIDDEN, key=key),
    "MinGRU": lambda key: nn.MinGRU(IN, HIDDEN, key=key),
    "MinLSTM": lambda key: nn.MinLSTM(IN, HIDDEN, key=key),
    "LRU": lambda key: nn.LRU(IN, HIDDEN, key=key),
    "GRUCell": lambda key: eqx.nn.GRUCell(IN, HIDDEN, key=key),
    "LSTMCell": lambda key: eqx.nn.LSTMCell(IN, HIDDEN, key=key),
}


def make(name, length, seed=0):
    kc, kx = jax.random.split(jax.random.PRNGKey(seed))
    return CELLS[name](kc), jax.random.normal(kx, (length, IN))


def initial_state(cell):
    if isinstance(cell, nn.AbstractCell):
        return cell.init_state()
    if isinstance(cell, eqx.nn.LSTMCell):
        return (jnp.zeros(HIDDEN), jnp.zeros(HIDDEN))
    return jnp.zeros(HIDDEN)


def hand_scan(cell, xs, h0=None, reverse=False):
    """The layer written by hand: `lax.scan` of `cell(x, h)`, then the readout."""
    h0 = initial_state(cell) if h0 is None else h0

    def body(h, x):
        h = cell(x, h)
        if isinstance(cell, nn.AbstractCell):
            return h, cell.readout(x, h)
        return h, (h[0] if isinstance(h, tuple) else h)  # an LSTM layer outputs h

    return lax.scan(body, h0, xs, reverse=reverse)[1]


@pytest.mark.parametrize("name", CELLS)
@pytest.mark.parametrize("length, reverse", [(1, False), (37, False), (10, True)])
def test_layer_matches_hand_written_scan(name, length, reverse):
    cell, xs = make(name, length)
    layer = nn.Recurrence(cell, reverse=reverse)
    ys = eqx.filter_jit(layer)(xs)
    expect = hand_scan(cell, xs, reverse=reverse)
    assert tree_allclose(ys, expect, rtol=1e-10, atol=1e-10)
    if name == "LRU":
        assert ys.shape == (length, IN) and not jnp.iscomplexobj(ys)


@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from(["ElmanCell", "MinGRU", "LRU", "GRUCell"]),
    length=st.integers(1, 80),
    in_features=st.integers(1, 4),
    hidden=st.integers(1, 5),
    reverse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layer_hypothesis(name, length, in_features, hidden, reverse, seed):
    """Any length and width (the default solver's checkpoint interval follows T)."""
    kc, kx, kh = jax.random.split(jax.random.PRNGKey(seed), 3)
    cell = {
        "ElmanCell": nn.ElmanCell,
        "MinGRU": nn.MinGRU,
        "LRU": nn.LRU,
        "GRUCell": eqx.nn.GRUCell,
    }[name](in_features, hidden, key=kc)
    xs = jax.random.normal(kx, (length, in_features))
    h0 = jax.random.normal(kh, (hidden,))
    if name == "LRU":
        h0 = h0 * (1 + 1j)
    ys = nn.Recurrence(cell, reverse=reverse)(xs, h0)
    assert tree_allclose(ys, hand_scan(cell, xs, h0, reverse), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", CELLS)
def test_gradients_reach_every_parameter(name):
    cell, xs = make(name, 29, seed=1)
    h0 = jax.tree_util.tree_map(lambda h: h + 0.3, initial_state(cell))
    weights = jax.random.normal(
        jax.random.PRNGKey(2), (29, IN if name == "LRU" else HIDDEN)
    )

    def loss(layer_fn):
        def f(cell, xs, h0):
            ys = layer_fn(cell, xs, h0)
            ys = ys[0] if isinstance(ys, tuple) else ys
            return jnp.sum(weights * ys)

        return f

    ours = loss(lambda c, xs, h0: nn.Recurrence(c)(xs, h0))
    ref = loss(lambda c, xs, h0: hand_scan(c, xs, h0))
    g = eqx.filter_jit(eqx.filter_grad(ours))(cell, xs, h0)
    g_ref = eqx.filter_grad(ref)(cell, xs, h0)
    leaves = jax.tree_util.tree_leaves(g)
    assert leaves and all(float(jnp.max(jnp.abs(x))) > 0 for x in leaves)
    assert tree_allclose(g, g_ref, rtol=1e-9, atol=1e-9)
    # gradients with respect to the inputs and the initial state too
    gx = jax.jit(jax.grad(ours, argnums=(1, 2)))(cell, xs, h0)
    assert tree_allclose(
        gx, jax.grad(ref, argnums=(1, 2))(cell, xs, h0), rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("name", ["ElmanCell", "MinGRU", "LRU"])
def test_check_grads(name):
    cell, xs = make(name, 7, seed=3)
    layer = nn.Recurrence(cell)
    f = lambda xs: jnp.real(layer(xs))
    check_grads(jax.jit(f), (xs,), order=1, modes=("rev", "fwd"))


@pytest.mark.parametrize(
    "solver",
    [
        pscan.Sequential(),
        pscan.Newton(chunk_size=8, rtol=1e-12, atol=1e-12),
        pscan.Picard(chunk_size=4, rtol=1e-12, atol=1e-12),
        pscan.ELK(chunk_size=4, rtol=1e-12, atol=1e-12),
    ],
    ids=["Sequential", "Newton", "Picard", "ELK"],
)
@pytest.mark.parametrize("name", ["ElmanCell", "MinGRU"])
def test_explicit_solver(name, solver):
    """A solver given explicitly is used, for linear cells too; gradients stay exact."""
    cell, xs = make(name, 23, seed=4)
    layer = nn.Recurrence(cell, solver)
    assert_allclose(layer(xs), hand_scan(cell, xs))
    g = eqx.filter_jit(
        eqx.filter_grad(lambda c: jnp.sum(nn.Recurrence(c, solver)(xs) ** 2))
    )(cell)
    g_ref = eqx.filter_grad(lambda c: jnp.sum(hand_scan(c, xs) ** 2))(cell)
    assert tree_allclose(g, g_ref, rtol=1e-9, atol=1e-9)


def test_batch_by_vmap_and_float32():
    cell = to_dtype(nn.ElmanCell(IN, HIDDEN, key=jax.random.PRNGKey(0)), jnp.float32)
    xs = jax.random.normal(jax.random.PRNGKey(1), (5, 40, IN), jnp.float32)
    ys = jax.vmap(nn.Recurrence(cell))(xs)
    assert ys.shape == (5, 40, HIDDEN) and ys.dtype == jnp.float32
    expect = jax.vmap(lambda xs: hand_scan(cell, xs))(xs)
    assert_allclose(ys, expect, jnp.float32)
    lru = nn.LRU(IN, HIDDEN, dtype=jnp.float32, key=jax.random.PRNGKey(2))
    assert lru.init_state().dtype == jnp.complex64
    assert jax.vmap(nn.Recurrence(lru))(xs).dtype == jnp.float32


def test_default_solver():
    if jax.default_backend() == "cpu":
        assert nn.default_solver(524288, jnp.float32) == pscan.Sequential(
            checkpoint=1024
        )
        assert nn.default_solver(1, jnp.float32) == pscan.Sequential(checkpoint=1)


def test_optax_training_step():
    """`eqx.filter_jit` + `eqx.filter_grad` + an optax update lower the loss."""
    key = jax.random.PRNGKey(0)
    model = (nn.Recurrence(nn.MinGRU(1, 8, key=key)), eqx.nn.Linear(8, 1, key=key))
    xs = jnp.sin(jnp.linspace(0, 20, 201))[:, None]
    optimiser = optax.adam(1e-2)
    state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))

    def loss(model):
        layer, head = model
        pred = jax.vmap(head)(layer(xs[:-1]))
        return jnp.mean((pred - xs[1:]) ** 2)

    @eqx.filter_jit
    def update(model, state):
        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = optimiser.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, value

    first = None
    for _ in range(20):
        model, state, value = update(model, state)
        first = value if first is None else first
    assert float(loss(model)) < 0.5 * float(first)


def test_bad_input_is_a_value_error():
    cell, xs = make("ElmanCell", 5)
    layer = nn.Recurrence(cell)
    with pytest.raises(
        ValueError, match=r"Recurrence\(ElmanCell\).*\(T, 3\).*\(2, 5, 3\)"
    ):
        layer(jnp.zeros((2, 5, 3)))
    with pytest.raises(ValueError, match=r"Recurrence\(ElmanCell\).*\(5, 2\)"):
        layer(jnp.zeros((5, 2)))
    with pytest.raises(ValueError, match=r"Recurrence\(ElmanCell\).*\(0, 3\)"):
        layer(jnp.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"Recurrence\(ElmanCell\): `h0`.*\(3,\)"):
        layer(xs, jnp.zeros(3))
    # one step: one input of one sequence, a state like the cell's
    with pytest.raises(ValueError, match=r"ElmanCell\)\.step: `x`.*\(3,\).*\(2, 3\)"):
        layer.step(jnp.zeros((2, 3)), jnp.zeros(4))
    with pytest.raises(ValueError, match=r"ElmanCell\): `h` must be.*\(4,\).*\(5,\)"):
        layer.step(jnp.zeros(3), jnp.zeros(5))
    with pytest.raises(ValueError, match=r"Recurrence\(GRUCell\).*\(7, 1\)"):
        nn.Recurrence(eqx.nn.GRUCell(3, 4, key=jax.random.PRNGKey(0)))(
            jnp.zeros((7, 1))
        )
    with pytest.raises(ValueError, match="`solver` must be None or a pscan solver"):
        nn.Recurrence(cell, "newton")
    with pytest.raises(ValueError, match=r"did you mean pscan.Picard\(\)"):
        nn.Recurrence(cell, pscan.Picard)
    # `length` and `resets` errors name the layer, not the function it calls
    with pytest.raises(
        ValueError, match=r"Recurrence\(ElmanCell\): `length`.*batch: jax.vmap"
    ):
        layer(xs, length=jnp.array([5, 3]))
    with pytest.raises(ValueError, match=r"Recurrence\(LRU\): `resets`.*\(5,\)"):
        nn.Recurrence(nn.LRU(3, 4, key=jax.random.PRNGKey(0)))(xs, resets=np.ones(5))
    with pytest.raises(ValueError, match=r"Recurrence: `throw` must be True or False"):
        nn.Recurrence(cell, throw="no")
    with pytest.raises(ValueError, match=r"Bidirectional: `return_state` must be True"):
        nn.Bidirectional(nn.Recurrence(cell), nn.Recurrence(cell), return_state=None)
    with pytest.raises(ValueError, match="pass `h0`"):
        nn.Recurrence(lambda x, h: h)(xs)
    with pytest.raises(
        ValueError, match=r"ElmanCell: `hidden_size` must be a positive"
    ):
        nn.ElmanCell(3, 0, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"MinGRU: `in_features` must be a positive"):
        nn.MinGRU(0, 3, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"LRU: `state_size` must be a positive"):
        nn.LRU(1, -2, key=jax.random.PRNGKey(0))
    # x64 on, a float32 layer, float64 inputs: the message names `xs`, not an
    # argument the user never passed
    for cell in (nn.LRU, nn.ElmanCell):
        layer = nn.Recurrence(cell(2, 3, dtype=jnp.float32, key=jax.random.PRNGKey(0)))
        with pytest.raises(ValueError, match=r"`xs` has dtype float64 but the cell's"):
            layer(jnp.ones((5, 2), jnp.float64))
    with pytest.raises(ValueError, match="r_min"):
        nn.LRU(3, 4, r_min=0.99, r_max=0.9, key=jax.random.PRNGKey(0))


def test_custom_cells():
    """A plain callable works when given `h0`; a user `AbstractLinearCell` with a shared
    coefficient runs through `linear_recurrence`."""

    class Decay(nn.AbstractLinearCell):
        log_rate: jax.Array

        def coefficients(self, xs):
            return jnp.exp(-jnp.exp(self.log_rate)), xs

        def init_state(self):
            return jnp.zeros(IN)

    cell = Decay(jnp.log(jnp.linspace(0.1, 1.0, IN)))
    xs = jax.random.normal(jax.random.PRNGKey(0), (13, IN))
    assert_allclose(nn.Recurrence(cell)(xs), hand_scan(cell, xs))
    assert_allclose(
        nn.Recurrence(cell, reverse=True)(xs), hand_scan(cell, xs, reverse=True)
    )

    class MLPCell(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, x, h):
            return jnp.tanh(self.mlp(jnp.concatenate([x, h])))

    mlp_cell = MLPCell(eqx.nn.MLP(IN + 2, 2, 8, 1, key=jax.random.PRNGKey(1)))
    out = nn.Recurrence(mlp_cell)(xs, jnp.zeros(2))
    expect = hand_scan(mlp_cell, xs, jnp.zeros(2))
    np.testing.assert_allclose(out, expect, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "solver",
    [
        pscan.Newton(chunk_size=8, rtol=1e-12, atol=1e-12),
        pscan.Picard(chunk_size=8),
        pscan.ELK(chunk_size=8, rtol=1e-12, atol=1e-12),
    ],
    ids=["Newton", "Picard", "ELK"],
)
def test_lru_through_iterative_solvers(solver):
    """`LRU`'s complex state through Newton/Picard/ELK: outputs and gradients equal the
    exact linear path's."""
    layer = nn.Recurrence(nn.LRU(1, 4, key=jax.random.PRNGKey(0)))
    xs = jax.random.normal(jax.random.PRNGKey(1), (37, 1))
    other = nn.Recurrence(layer.cell, solver=solver)
    assert_allclose(other(xs), layer(xs))
    loss = lambda m: jnp.sum(m(xs) ** 2)
    g, g_ref = eqx.filter_grad(loss)(other), eqx.filter_grad(loss)(layer)
    assert tree_allclose(g.cell, g_ref.cell, rtol=1e-8, atol=1e-8)


def _leaves_close(x, y, **kwargs):
    return tree_allclose(x, y, **{"rtol": 1e-10, "atol": 1e-10, **kwargs})


@pytest.mark.parametrize("name", CELLS)
def test_carried_state_and_stepping(name):
    """`return_state=True`: the final state is the cell's own (complex for LRU, `(h, c)`
    for an LSTM), and two windows with the state carried equal one pass; `step` from
    `init_state()` generates the same outputs one at a time; fixed-length windows
    compile once."""
    cell, xs = make(name, 24)
    layer = nn.Recurrence(cell, return_state=True)
    ys, state = layer(xs)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(
        initial_state(cell)
    )
    traces = []

    @jax.jit
    def window(x, h):
        traces.append(None)
        return layer(x, h)

    h, outs = layer.init_state(), []
    for x in jnp.split(xs, 3):
        y, h = window(x, h)
        outs.append(y)
    assert len(traces) == 1  # the carried state recompiles nothing
    assert _leaves_close(jnp.concatenate(outs), ys)
    assert _leaves_close(h, state)
    h, outs = layer.init_state(), []
    for x in xs:
        y, h = layer.step(x, h)
        outs.append(y)
    assert _leaves_close(jnp.stack(outs), ys)
    assert _leaves_close(h, state)


@pytest.mark.parametrize("name", ["ElmanCell", "LRU", "LSTMCell"])
def test_padded_batch_with_lengths(name):
    """A right-padded batch under `jax.vmap`, one `length` per sequence: each equals its
    real prefix alone (forward, and backward from step `length - 1`), padded steps
    output zeros, and the final state is the one after the last real step."""
    cell, xs = make(name, 16)
    batch = jnp.stack([xs, 2 * xs, -xs])
    lengths = jnp.array([1, 9, 16])
    for reverse in (False, True):
        layer = nn.Recurrence(cell, reverse=reverse, return_state=True)
        run = eqx.filter_jit(jax.vmap(lambda x, n: layer(x, length=n)))
        ys, states = run(batch, lengths)
        for i, n in enumerate(lengths.tolist()):
            y_ref, s_ref = layer(batch[i, :n])
            assert _leaves_close(ys[i, :n], y_ref)
            assert not np.any(np.asarray(ys[i, n:]))
            state = jax.tree_util.tree_map(lambda s: s[i], states)
            assert _leaves_close(state, s_ref)


@pytest.mark.parametrize("name", ["ElmanCell", "LRU"])
def test_nan_padding_leaves_gradients_finite(name):
    """A padded batch whose padding is NaN (missing samples): the outputs and every
    gradient equal those with zero padding (the padded steps' outputs, states and
    derivatives are discarded; NaN derivatives made all of them NaN)."""
    cell, xs = make(name, 16)
    layer = nn.Recurrence(cell)
    lengths = jnp.array([5, 16])
    loss = lambda layer, batch: jnp.sum(
        jax.vmap(lambda x, n: layer(x, length=n))(batch, lengths) ** 2
    )
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    pad = jnp.arange(16)[:, None] >= 5
    nan_batch = jnp.stack([jnp.where(pad, jnp.nan, xs), xs])
    zero_batch = jnp.stack([jnp.where(pad, 0.0, xs), xs])
    got, want = grad(layer, nan_batch), grad(layer, zero_batch)
    leaves = jax.tree_util.tree_leaves(eqx.filter(got, eqx.is_inexact_array))
    assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
    assert tree_allclose(got, want)


def test_packed_batch_with_resets():
    """A packed sequence: each segment's outputs equal the layer on it alone, forward
    and backward, and in `Bidirectional`."""
    cell, xs = make("GRUCell", 20)
    resets = np.isin(np.arange(20), [0, 1, 8, 15])
    bounds = [(0, 1), (1, 8), (8, 15), (15, 20)]
    for reverse in (False, True):
        layer = nn.Recurrence(cell, reverse=reverse)
        ys = layer(xs, resets=resets)
        for s, e in bounds:
            assert _leaves_close(ys[s:e], layer(xs[s:e]))
    bi = nn.Bidirectional(nn.Recurrence(cell), nn.Recurrence(cell))
    ys = bi(xs, resets=resets)
    assert ys.shape == (20, 2 * HIDDEN)
    for s, e in bounds:
        assert _leaves_close(ys[s:e], bi(xs[s:e]))


def test_bidirectional():
    """Concatenated forward and backward passes (the backward layer runs backward
    whatever its own flag), respecting `length`; `return_state` gives both states."""
    kf, kb, kx = jax.random.split(jax.random.PRNGKey(4), 3)
    forward = nn.Recurrence(nn.ElmanCell(IN, HIDDEN, key=kf))
    backward = nn.Recurrence(eqx.nn.LSTMCell(IN, 2, key=kb))
    xs = jax.random.normal(kx, (11, IN))
    bi = nn.Bidirectional(forward, backward, return_state=True)
    ys, (s_f, s_b) = bi(xs, length=7)
    assert ys.shape == (11, HIDDEN + 2)
    y_f, ref_f = nn.Recurrence(forward.cell, return_state=True)(xs[:7])
    reverse = nn.Recurrence(backward.cell, reverse=True, return_state=True)
    y_b, ref_b = reverse(xs[:7])
    assert _leaves_close(ys[:7], jnp.concatenate([y_f, y_b], -1))
    assert not np.any(np.asarray(ys[7:]))
    assert _leaves_close((s_f, s_b), (ref_f, ref_b))
    with pytest.raises(
        ValueError, match="`backward_layer` must be a pscan.nn.Recurrence"
    ):
        nn.Bidirectional(forward, backward.cell)


def test_equinox_sequential_composition():
    """Layers take `key=` as Equinox layers do: `eqx.nn.Sequential` of pscan layers
    (an LSTM's outputs are `h`, one array per step) and Equinox layers."""
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    model = eqx.nn.Sequential(
        [
            nn.Recurrence(eqx.nn.LSTMCell(IN, HIDDEN, key=keys[0])),
            nn.Recurrence(nn.LRU(HIDDEN, 8, key=keys[1])),
            eqx.nn.Lambda(jax.nn.gelu),
            nn.Bidirectional(
                nn.Recurrence(nn.MinGRU(HIDDEN, 2, key=keys[2])),
                nn.Recurrence(nn.ElmanCell(HIDDEN, 2, key=keys[3])),
            ),
        ]
    )
    xs = jax.random.normal(keys[0], (9, IN))
    assert eqx.filter_jit(model)(xs, key=keys[1]).shape == (9, 4)


@pytest.mark.parametrize("name", CELLS)
def test_nonfinite_inputs_propagate_without_error(name):
    """A NaN in `xs`: outputs before it exact, non-finite after it, no exception from
    inside jit (the default `throw=True`), for linear and nonlinear cells alike."""
    cell, xs = make(name, 20)
    bad = xs.at[11, 0].set(jnp.nan)
    ys = eqx.filter_jit(nn.Recurrence(cell))(bad)
    assert _leaves_close(ys[:11], hand_scan(cell, xs[:11]))
    assert not np.any(np.isfinite(np.asarray(ys[11:])).all(axis=-1))
    newton = nn.Recurrence(cell, solver=pscan.Newton(chunk_size=4))
    ys = eqx.filter_jit(newton)(bad)
    assert _leaves_close(ys[:11], hand_scan(cell, xs[:11]), rtol=1e-5, atol=1e-5)
    assert not np.any(np.isfinite(np.asarray(ys[11:])).all(axis=-1))


def test_layer_throw():
    """`throw=True` raises for a solver that did not converge on finite data;
    `throw=False` returns the last iterate."""
    cell, xs = make("GRUCell", 40)
    solver = pscan.Newton(chunk_size=2, max_iters=1)
    with pytest.raises(Exception, match="did not converge"):
        jax.block_until_ready(nn.Recurrence(cell, solver=solver)(xs))
    ys = nn.Recurrence(cell, solver=solver, throw=False)(xs)
    assert ys.shape == (40, HIDDEN)


@pytest.mark.parametrize(
    "solver",
    [pscan.Sequential(), pscan.Picard(chunk_size=8), pscan.Newton(chunk_size=8)]
    + [pscan.ELK(chunk_size=8)],
    ids=lambda s: type(s).__name__,
)
def test_layers_export(solver):
    """A layer exports with `jax.export` (as the docs say: the iterating solvers with
    `throw=False`, whose program then has no host callback) and the exported program
    gives the layer's outputs."""
    cell, xs = make("GRUCell", 40)
    layer = nn.Recurrence(cell, solver=solver, throw=False)
    spec = jax.ShapeDtypeStruct(xs.shape, xs.dtype)
    exported = jax.export.export(jax.jit(lambda xs: layer(xs)))(spec)
    out = exported.call(xs)
    assert_allclose(out, layer(xs))
    # and the states (the solvers' default tolerances: 1e-6)
    np.testing.assert_allclose(out, nn.Recurrence(cell)(xs), rtol=1e-5, atol=1e-5)
