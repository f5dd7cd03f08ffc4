"""Shared test helpers: random problems and float64 references."""

import contextlib
import re

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

KINDS = ("diagonal", "scalar", "dense")


def tolerance(dtype) -> dict:
    """`rtol`/`atol` for comparing against a float64 reference."""
    if jnp.finfo(dtype).bits <= 32:
        return dict(rtol=2e-4, atol=2e-4)
    return dict(rtol=1e-10, atol=1e-10)


def make_linear_problem(seed, length, state=(3,), kind="diagonal", dtype=np.float64):
    """Random stable `(a, b, h0)` for `linear_recurrence`.

    `kind` is `"diagonal"` (`a` like `b`), `"scalar"` (one coefficient per step, shape
    `(T, 1, ...)`) or `"dense"` (`a` of shape `(T, *S[:-1], d, d)`). Coefficients have
    modulus below one so that long sequences stay bounded.
    """
    rng = np.random.default_rng(seed)
    cplx = np.issubdtype(dtype, np.complexfloating)

    def draw(shape, scale=1.0):
        x = rng.normal(size=shape) * scale
        if cplx:
            x = x + 1j * rng.normal(size=shape) * scale
        return x

    if kind == "diagonal":
        a = rng.uniform(0.3, 0.99, (length, *state)) * np.exp(
            1j * rng.uniform(-1, 1, (length, *state)) if cplx else 0
        )
    elif kind == "scalar":
        shape = (length, *([1] * len(state)))
        a = rng.uniform(0.3, 0.99, shape) * np.exp(
            1j * rng.uniform(-1, 1, shape) if cplx else 0
        )
    elif kind == "dense":
        d = state[-1]
        a = draw((length, *state[:-1], d, d), 0.9 / np.sqrt(2 * d))
    else:
        raise ValueError(kind)
    b = draw((length, *state))
    h0 = draw(state)
    return a.astype(dtype), b.astype(dtype), h0.astype(dtype)


def reference_linear(a, b, h0=None, reverse=False):
    """The recurrence by a plain Python loop in float64 / complex128 numpy."""
    a = np.asarray(a)
    b = np.asarray(b)
    dtype = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    a, b = a.astype(dtype), b.astype(dtype)
    dense = a.ndim == b.ndim + 1
    h = np.zeros(b.shape[1:], dtype) if h0 is None else np.asarray(h0, dtype)
    a = np.broadcast_to(a, (b.shape[0], *a.shape[1:])) if a.ndim == b.ndim + 1 else a
    a = a.reshape((1,) * (b.ndim - a.ndim) + a.shape) if not dense else a
    hs = np.zeros(b.shape, dtype)
    steps = range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0])
    for t in steps:
        a_t = a[min(t, a.shape[0] - 1)]
        h = (a_t @ h[..., None])[..., 0] + b[t] if dense else a_t * h + b[t]
        hs[t] = h
    return hs


def scan_linear(a, b, h0, reverse=False):
    """The recurrence by a plain `lax.scan`, differentiated by JAX's own autodiff."""
    dense = a.ndim == b.ndim + 1

    def step(h, ab):
        a_t, b_t = ab
        h = (a_t @ h[..., None])[..., 0] + b_t if dense else a_t * h + b_t
        return h, h

    a = jnp.broadcast_to(a, (b.shape[0], *a.shape[1:]))
    return lax.scan(step, h0, (a, b), reverse=reverse)[1]


def random_cotangent(seed, like):
    """A random array shaped like `like` (complex if `like` is)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=like.shape)
    if jnp.iscomplexobj(like):
        x = x + 1j * rng.normal(size=like.shape)
    return jnp.asarray(x, like.dtype)


def assert_allclose(actual, desired, dtype=None):
    dtype = jnp.result_type(actual) if dtype is None else dtype
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(desired), **tolerance(dtype)
    )


def tree_allclose(x, y, **kwargs) -> bool:
    """Whether two pytrees have the same structure, and leaves of the same shapes that
    are close (`np.allclose` keywords). A missing leaf, another structure or a shape
    that merely broadcasts is `False`, never zipped or broadcast away."""
    if jax.tree_util.tree_structure(x) != jax.tree_util.tree_structure(y):
        return False
    for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or not np.allclose(a, b, **kwargs):
            return False
    return True


def loop_body_copies(hlo_text: str, min_elements: int) -> list[str]:
    """Lines of `while` bodies in compiled HLO text that copy an array of at least
    `min_elements` elements.

    A T-long buffer copied inside a loop body makes the loop O(T^2) (jax #10197).
    """
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    copy = re.compile(r"= \w+\[([\d,]*)\]\S* copy\(")
    found, current = [], None
    for line in hlo_text.splitlines():
        header = re.match(r"^%?([\w.\-]+) \(.*\{$", line)
        if header:
            current = header.group(1)
        elif line.startswith("}"):
            current = None
        elif current in bodies and (m := copy.search(line)):
            if (
                int(np.prod([int(n) for n in m.group(1).split(",") if n]))
                >= min_elements
            ):
                found.append(line.strip())
    return found


class ElmanCell(eqx.Module):
    """`tanh(W x + U h + b)`: a test cell (the library's own lives in `pscan.nn`)."""

    w: jax.Array
    u: jax.Array
    bias: jax.Array

    def __init__(self, n_in, n_hidden, *, key, scale=1.0, dtype=jnp.float64):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w = jax.random.normal(k1, (n_hidden, n_in), dtype) / n_in**0.5
        self.u = (
            scale * jax.random.normal(k2, (n_hidden, n_hidden), dtype) / n_hidden**0.5
        )
        self.bias = 0.1 * jax.random.normal(k3, (n_hidden,), dtype)

    def __call__(self, x, h):
        return jnp.tanh(self.w @ x + self.u @ h + self.bias)


def dot_precisions(fn, *args) -> list:
    """The `precision` of every matrix product in the jaxpr of `fn(*args)`, inside
    loops, conditionals and custom rules too (None: the default precision)."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                precision = eqn.params["precision"]
                found.append(precision if precision is None else tuple(precision))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns"):
                        visit(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        visit(sub.jaxpr)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def to_dtype(tree, dtype):
    """Casts every floating array of a pytree (e.g. an Equinox cell) to `dtype`."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree
    )


def scan_cell(cell, xs, h0):
    """The recurrence by a plain `lax.scan` (JAX's own autodiff differentiates it)."""

    def step(h, x):
        h = cell(x, h)
        return h, h

    return lax.scan(step, h0, xs)[1]


def assert_exact_derivatives(
    solver,
    cell,
    xs,
    h0,
    *,
    scalar=None,
    tangents=None,
    leaf=lambda c: c.weight_hh,
    **options,
):
    """Through `solver`, the gradient of a loss `scalar(hs)` (default: a weighted sum of
    `sin(hs)`) wrt the cell (its array `leaf`), `xs` and `h0`, and the tangent for
    `tangents` of `(xs, h0)` (default: `(sin(xs), 1)`), equal autodiff through
    `lax.scan` (`scan_cell`); `options` go to `pscan.recurrence` (e.g. `guess`). (One
    compiled program each: compiling dominates at test sizes.)"""
    import pscan

    if scalar is None:
        w = jnp.cos(jnp.arange(float(xs.shape[0] * h0.shape[0])))
        scalar = lambda hs: jnp.sum(w.reshape(hs.shape) * jnp.sin(hs))
    if tangents is None:
        tangents = (jnp.sin(xs), jnp.ones_like(h0))
    loss = lambda run: lambda args: scalar(run(*args))
    ours = lambda c, xs, h0: pscan.recurrence(c, xs, h0, solver=solver, **options).hs
    g = eqx.filter_jit(eqx.filter_grad(loss(ours)))((cell, xs, h0))
    g_ref = eqx.filter_grad(loss(scan_cell))((cell, xs, h0))
    assert_allclose(leaf(g[0]), leaf(g_ref[0]))
    assert_allclose(g[1], g_ref[1])
    assert_allclose(g[2], g_ref[2])
    jvp = lambda run: eqx.filter_jit(
        lambda: jax.jvp(lambda *a: run(cell, *a), (xs, h0), tangents)[1]
    )
    assert_allclose(jvp(ours)(), jvp(scan_cell)())


@contextlib.contextmanager
def compiles():
    """The XLA compilations inside the block: yields a list that collects the name
    of every program compiled there."""
    names = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
