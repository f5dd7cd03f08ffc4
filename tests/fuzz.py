"""Random configurations against the sequential answer, for a set time: by hand, not
part of the suite (pytest collects `test_*.py` only). The suite's cases are fixed;
this draws lengths, chunk sizes, resets, lengths of padded series, directions,
zeros, non-finite inputs and solvers at random, in float64 (float32 with
`--float32`, at float32 tolerances and on contractive cells only), and prints every
configuration whose states, flag, gradient or tangent differ from the exact loop's
(or that raises). It found bugs that no fixed case covered: 2026-12-07, a sharded
solve flagging NaN states `successful` and sharded derivatives through a zero `h0`;
2026-12-08 (float32, a NaN tangent), a NaN crossing the resets of a dense linear
recurrence (states and derivatives, even the sequential method's, so the float64
comparison with it saw nothing), and through the tangents of the exact-Jacobian
solvers (an infinite input: finite states, a NaN tangent), sharded too.

    python tests/fuzz.py recurrence --seconds 300
    python tests/fuzz.py linear | layers | associative [--seed N]
    python tests/fuzz.py sharded | sharded-linear | sharded-associative
    python tests/fuzz.py recurrence --float32   # on an accelerator too

The references are pscan's own sequential paths (`Sequential()`, which is
`lax.scan`; `method="sequential"`; a loop of `Recurrence.step`), which the suite
checks against NumPy loops.
"""

import argparse
import dataclasses
import os
import random
import sys
import time

MODES = (
    "recurrence",
    "linear",
    "layers",
    "associative",
    "sharded",
    "sharded-linear",
    "sharded-associative",
)
ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("mode", choices=MODES)
ARGS.add_argument("--seconds", type=float, default=120.0)
ARGS.add_argument("--seed", type=int, default=0)
ARGS.add_argument("--float32", action="store_true", help="x64 off, float32 limits")
X64 = True
if __name__ == "__main__":
    OPTIONS = ARGS.parse_args()
    X64 = not OPTIONS.float32
    if OPTIONS.mode.startswith("sharded"):  # before JAX starts
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

jax.config.update("jax_enable_x64", X64)
# the references are exact loops: in float32 at full precision on a TPU too (where
# the default is bfloat16 passes; pscan's parallel solvers use "highest" anyway)
jax.config.update("jax_default_matmul_precision", None if X64 else "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import pscan  # noqa: E402
import pscan.nn as nn  # noqa: E402

FLOAT = jnp.float64 if X64 else jnp.float32
TOL = 1e-11 if X64 else 1e-6  # the solvers' rtol and atol

sys.path.insert(0, os.path.dirname(__file__))
from helpers import ElmanCell  # noqa: E402


def gap(x, y) -> float:
    """The largest difference relative to `1 + max |y|` over two pytrees; inf when
    their non-finite entries differ."""
    worst = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
        a, b = np.asarray(a), np.asarray(b)
        if b.dtype == bool:
            a, b = a.astype(np.int8), b.astype(np.int8)
        if not (
            np.array_equal(np.isnan(a), np.isnan(b))
            and np.array_equal(np.isinf(a), np.isinf(b))
        ):
            return np.inf
        finite = np.isfinite(b)
        scale = 1 + np.max(np.abs(b[finite]), initial=0.0)
        worst = max(worst, np.max(np.abs(a - b)[finite], initial=0.0) / scale)
    return float(worst)


def segments(rng, g, steps):
    """Random `resets` and `length` (either may be None)."""
    resets = None if rng.random() < 0.5 else g.random(steps) < rng.choice([0.05, 0.3])
    length = None if rng.random() < 0.5 else rng.randint(-1, steps + 1)
    return resets, length


def nonlinear_solver(rng, steps, axis_name=None):
    """A random parallel solver that reaches the answer within its `max_iters`."""
    c = rng.choice([1, 2, 3, 5, 8, 16])
    opts = dict(chunk_size=c, max_iters=steps + 5, rtol=TOL, atol=TOL)
    opts["axis_name"] = axis_name
    jacobian = rng.choice(["dense", "diagonal"])
    return rng.choice(
        [
            lambda: pscan.Picard(**opts),
            lambda: pscan.Newton(jacobian=jacobian, **opts),
            lambda: pscan.ELK(
                jacobian=jacobian,
                kalman=rng.choice([None, "filter", "smoother"]),
                method=rng.choice(["auto", "sequential", "associative", "chunked"]),
                **opts,
            ),
        ]
    )()


def cell_problem(rng, seed, steps):
    """An Elman cell (contractive or not), inputs with a NaN or inf now and then, and
    `h0` (zero now and then)."""
    key = jax.random.PRNGKey(seed)
    d, m = rng.choice([1, 2, 5]), rng.choice([1, 3])
    scale = rng.choice([0.5, 0.9, 1.5] if X64 else [0.5, 0.9])
    cell = ElmanCell(m, d, key=key, scale=scale)
    xs = jax.random.normal(jax.random.fold_in(key, 1), (steps, m))
    if rng.random() < 0.25:
        xs = xs.at[rng.randrange(steps), 0].set(rng.choice([np.nan, np.inf]))
    h0 = 0.5 * jax.random.normal(jax.random.fold_in(key, 2), (d,))
    return cell, xs, h0 * (rng.random() < 0.8), scale


def check_recurrence(rng, g, seed, axis=None):
    """`recurrence` (or `sharded_recurrence` over `axis`, a mesh) against
    `Sequential()`: states, flag, gradient and tangent."""
    steps = rng.choice([1, 2, 3, 7, 13, 31, 64, 97, 200])
    cell, xs, h0, scale = cell_problem(rng, seed, steps)
    resets, length = segments(rng, g, steps)
    reverse = axis is None and rng.random() < 0.4
    solver = nonlinear_solver(rng, steps, None if axis is None else "t")
    if axis is None and rng.random() < 0.25:  # the exact answer after a few steps
        solver = dataclasses.replace(
            solver, fallback="sequential", max_iters=rng.choice([1, 2, 3])
        )
    if axis is None and rng.random() < 0.15:
        solver = pscan.Sequential(checkpoint=rng.choice([1, 3, 16]))
    masks = dict(resets=resets, length=length)
    guess = None

    def solve(s):
        if axis is not None and s is solver:
            run = pscan.sharded_recurrence
            return lambda *a: run(*a, solver=s, mesh=axis, axis_name="t", **masks)
        return lambda *a: pscan.recurrence(
            *a, solver=s, reverse=reverse, guess=guess, **masks
        )

    exact = jax.jit(lambda *a: solve(pscan.Sequential())(*a).hs)(cell, xs, h0)
    if axis is None and rng.random() < 0.3:  # a warm start: near, far, or NaN
        noise = rng.choice([0.0, 1e-3, 1.0, np.nan]) * g.standard_normal(exact.shape)
        guess = exact + noise
    sol = jax.jit(lambda *a: solve(solver)(*a))(cell, xs, h0)
    finite = bool(np.all(np.isfinite(exact)))
    flag = pscan.RESULTS.successful if finite else pscan.RESULTS.nonfinite
    found = {"states": gap(sol.hs, exact)}
    if not bool(sol.stats["fell_back"]):  # the flag of a fallback is the loop's
        found["flag"] = 0.0 if sol.result == flag else 1.0
    if finite:
        w = jax.random.normal(jax.random.PRNGKey(seed + 1), exact.shape)
        loss = lambda s: lambda *a: jnp.sum(w * solve(s)(*a).hs)
        grads = lambda s: jax.jit(jax.grad(loss(s), argnums=(0, 1, 2)))(cell, xs, h0)
        found["gradient"] = gap(grads(solver), grads(pscan.Sequential()))
        tangents = jax.tree_util.tree_map(jnp.cos, (cell, xs, h0))
        jvp = lambda s: jax.jit(
            lambda p, t: jax.jvp(lambda *a: solve(s)(*a).hs, p, t)[1]
        )((cell, xs, h0), tangents)
        found["tangent"] = gap(jvp(solver), jvp(pscan.Sequential()))
    limit = (1e-6 if scale > 1 else 1e-7) if X64 else 1e-4  # tolerances on starts
    where = f"T={steps} scale={scale} {masks} reverse={reverse} {solver}"
    return f"{where} guess={guess is not None}", found, limit


def linear_problem(rng, g, steps, dense_ok=True):
    """`(a, b, h0)` of a random kind: per step, shared, one per step, dense (with
    leading axes); complex now and then; exact zeros and non-finite inputs too."""
    d = rng.choice([1, 2, 4])
    state = rng.choice([(d,), (2, d)])
    complex_ = rng.random() < 0.3

    def rnd(shape, scale=1.0):
        x = scale * g.standard_normal(shape)
        return x + 1j * scale * g.standard_normal(shape) if complex_ else x

    if dense_ok and rng.random() < 0.3:
        lead = rng.choice([state[:-1], (1,) * (len(state) - 1)])
        a = rnd((rng.choice([steps, 1]), *lead, d, d), 0.9 / np.sqrt(d))
    else:
        shapes = [(steps, *state), state, (steps,) + (1,) * len(state), ()]
        a = np.asarray(rnd(rng.choice(shapes), 0.6))
        if a.size > 1 and rng.random() < 0.2:
            a.flat[g.integers(0, a.size)] = 0
    b = rnd((steps, *state))
    if rng.random() < 0.2:
        b.flat[g.integers(0, b.size)] = rng.choice([np.nan, np.inf])
    return a, b, rnd(state) * (rng.random() < 0.8)


def check_linear(rng, g, seed, axis=None):
    """`linear_recurrence` by a random method (or sharded over `axis`, a mesh)
    against `method="sequential"`: states, gradient and tangent."""
    steps = rng.choice([1, 2, 3, 5, 7, 16, 31, 64, 100, 257])
    a, b, h0 = linear_problem(rng, g, steps)
    resets, length = segments(rng, g, steps)
    reverse = rng.random() < 0.4
    method = rng.choice(["auto", "sequential", "associative", "chunked"])
    size = rng.choice([None, 1, 2, 3, 8]) if method == "chunked" else None
    opts = dict(reverse=reverse, resets=resets, length=length)

    def solve(method, size):
        if axis is not None and method != "reference":
            run = pscan.sharded_linear_recurrence
            return lambda a, b, h0: run(
                a,
                b,
                h0,
                mesh=axis,
                axis_name="t",
                method=method,
                chunk_size=size,
                **opts,
            )
        method = "sequential" if method == "reference" else method
        return lambda a, b, h0: pscan.linear_recurrence(
            a, b, h0, method=method, chunk_size=size, **opts
        )

    exact = jax.jit(solve("reference", None))(a, b, h0)
    found = {"states": gap(jax.jit(solve(method, size))(a, b, h0), exact)}
    # derivatives on non-finite data too (their NaN where the loop's are), and now
    # and then a NaN in the cotangent or tangent itself
    w = g.standard_normal(b.shape)
    tangents = [g.standard_normal(np.shape(x)).astype(x.dtype) for x in (a, b, h0)]
    if rng.random() < 0.2:
        w.flat[g.integers(0, w.size)] = np.nan
        tangents[1].flat[g.integers(0, b.size)] = np.nan
    loss = lambda f: lambda *x: jnp.real(jnp.sum(w * f(*x)))
    grads = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(a, b, h0)
    found["gradient"] = gap(grads(solve(method, size)), grads(solve("reference", None)))
    jvp = lambda f: jax.jvp(f, (a, b, h0), tuple(tangents))[1]
    found["tangent"] = gap(jvp(solve(method, size)), jvp(solve("reference", None)))
    where = f"T={steps} a{np.shape(a)} b{b.shape} {b.dtype} {opts} {method} {size}"
    return where, found, 1e-10 if X64 else 1e-4


def check_layers(rng, g, seed):
    """`nn.Recurrence` over every kind of cell and solver against a loop of its own
    `step`: outputs, final state, gradient; a stream cut in two windows."""
    key = jax.random.PRNGKey(seed)
    steps, m, d = rng.choice([1, 2, 5, 13, 40, 97]), rng.choice([1, 3]), 4
    kind = rng.choice(["elman", "gru", "lstm", "lru", "mingru", "minlstm"])
    make = {
        "elman": nn.ElmanCell,
        "gru": eqx.nn.GRUCell,
        "lstm": eqx.nn.LSTMCell,
        "lru": nn.LRU,
        "mingru": nn.MinGRU,
        "minlstm": nn.MinLSTM,
    }[kind]
    cell = make(m, d, key=key, dtype=FLOAT)
    nonlinear = kind in ("elman", "gru", "lstm")
    solver = nonlinear_solver(rng, steps) if nonlinear and rng.random() < 0.8 else None
    reverse = rng.random() < 0.4
    layer = nn.Recurrence(cell, solver=solver, reverse=reverse, return_state=True)
    xs = jax.random.normal(jax.random.fold_in(key, 1), (steps, m))
    resets, length = segments(rng, g, steps)
    h0 = jax.tree_util.tree_map(
        lambda x: 0.3 * jax.random.normal(jax.random.fold_in(key, 2), x.shape, x.dtype),
        layer.init_state(),
    )

    def loop(layer, xs, h0):
        real = steps if length is None else max(0, min(length, steps))
        outputs, h = [None] * steps, h0
        for t in range(real - 1, -1, -1) if reverse else range(real):
            after = t + 1 < real and resets is not None and resets[t + 1]
            if resets is not None and (after if reverse else resets[t]):
                h = h0
            outputs[t], h = layer.step(xs[t], h)
        zero = jnp.zeros_like(layer.step(xs[0], h0)[0])
        return jnp.stack([zero if y is None else y for y in outputs]), h

    run = lambda layer, xs, h0: layer(xs, h0, resets=resets, length=length)
    found = {"outputs": gap(eqx.filter_jit(run)(layer, xs, h0), loop(layer, xs, h0))}
    w = jax.random.normal(
        jax.random.fold_in(key, 3), (steps, loop(layer, xs, h0)[0].shape[1])
    )
    loss = lambda f: lambda *x: jnp.real(jnp.sum(w * f(*x)[0]))
    found["gradient"] = gap(
        eqx.filter_jit(eqx.filter_grad(loss(run)))(layer, xs, h0),
        eqx.filter_grad(loss(loop))(layer, xs, h0),
    )
    if not reverse and resets is None and length is None and steps > 2:
        first, h = layer(xs[: steps // 2], h0)
        second, _ = layer(xs[steps // 2 :], h)
        found["windows"] = gap(jnp.concatenate([first, second]), run(layer, xs, h0)[0])
    padded = f"resets={resets is not None} length={length}"
    where = f"T={steps} {kind} {solver} reverse={reverse} {padded}"
    return where, found, 1e-8 if X64 else 1e-4


def _affine(earlier, later):
    """Affine maps `h -> A h + b` composed (pytree elements; not commutative)."""
    mul = lambda m, v: jnp.einsum("...ij,...j->...i", m, v)
    A = jnp.einsum("...ij,...jk->...ik", later["A"], earlier["A"])
    return {"A": A, "b": mul(later["A"], earlier["b"]) + later["b"]}


def _logsumexp(earlier, later):
    """`(max, sum of exp below it)` pairs: a stable log-sum-exp (a tuple)."""
    (m1, s1), (m2, s2) = earlier, later
    m = jnp.maximum(m1, m2)
    return m, s1 * jnp.exp(m1 - m) + s2 * jnp.exp(m2 - m)


def _segmented_sum(earlier, later):
    """Sums that restart at a flag (a bool leaf beside a float one)."""
    (f1, v1), (f2, v2) = earlier, later
    return f1 | f2, jnp.where(f2, v2, v1 + v2)


def _matmul(earlier, later):
    """Products of square matrices (complex now and then)."""
    return later @ earlier


def check_bidirectional(rng, g, seed):
    """`nn.Bidirectional` of two random layers (either direction flag on the backward
    one) against the two exact layers run forward and backward: outputs, final
    states, gradient wrt the layers and the inputs."""
    key = jax.random.PRNGKey(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    steps, m = rng.choice([1, 2, 3, 17, 40]), rng.choice([1, 2])
    kinds = [nn.ElmanCell, nn.MinGRU, eqx.nn.GRUCell, eqx.nn.LSTMCell]
    cells = [rng.choice(kinds)(m, 3, key=k, dtype=FLOAT) for k in (k1, k2)]
    solvers = [
        None
        if isinstance(c, nn.MinGRU) or rng.random() < 0.3
        else nonlinear_solver(rng, steps)
        for c in cells
    ]
    backward_flag = rng.random() < 0.5
    layers = (
        nn.Recurrence(cells[0], solver=solvers[0]),
        nn.Recurrence(cells[1], solver=solvers[1], reverse=backward_flag),
    )
    both = nn.Bidirectional(*layers, return_state=True)
    xs = jax.random.normal(k3, (steps, m))
    resets, length = segments(rng, g, steps)
    masks = dict(resets=resets, length=length)

    def reference(both, xs):
        run = lambda cell, reverse: nn.Recurrence(
            cell, solver=pscan.Sequential(), reverse=reverse, return_state=True
        )(xs, **masks)
        (y1, h1), (y2, h2) = (
            run(both.forward_layer.cell, False),
            run(both.backward_layer.cell, True),
        )
        return jnp.concatenate([y1, y2], axis=-1), (h1, h2)

    run = lambda both, xs: both(xs, **masks)
    found = {"outputs": gap(eqx.filter_jit(run)(both, xs), reference(both, xs))}
    w = jax.random.normal(k4, reference(both, xs)[0].shape)
    loss = lambda f: lambda both_xs: jnp.sum(w * f(*both_xs)[0])
    found["gradient"] = gap(
        eqx.filter_jit(eqx.filter_grad(loss(run)))((both, xs)),
        eqx.filter_grad(loss(reference))((both, xs)),
    )
    names = [type(c).__name__ for c in cells]
    where = f"T={steps} {names} {solvers} backward reverse={backward_flag} {masks}"
    return where, found, 1e-8 if X64 else 1e-4


def combine_problem(rng, g, steps):
    """A random associative `combine`, its `elems`, and which leaves are differentiable
    (the rest are held fixed)."""
    kind = rng.choice(["affine", "logsumexp", "segmented", "matmul"])
    lead = rng.choice([(), (2,)])
    d = rng.choice([1, 3])
    rnd = lambda *shape: g.standard_normal((steps, *lead, *shape))
    if kind == "affine":
        elems = {"A": 0.9 * rnd(d, d) / np.sqrt(d), "b": rnd(d)}
        return _affine, elems, lambda e: e, lambda e, x: x
    if kind == "logsumexp":
        elems = (3 * rnd(d), np.exp(rnd(d)))
        return _logsumexp, elems, lambda e: e, lambda e, x: x
    if kind == "segmented":
        flags = g.random((steps, *lead, d)) < 0.2
        return (
            _segmented_sum,
            (flags, rnd(d)),
            lambda e: e[1],
            lambda e, x: (e[0], x),
        )
    m = 0.9 * rnd(d, d) / np.sqrt(d)
    if rng.random() < 0.3:
        m = m + 0.9j * rnd(d, d) / np.sqrt(d)
    return _matmul, m, lambda e: e, lambda e, x: x


def check_associative(rng, g, seed, axis=None):
    """`associative_scan` by a random method (inside `shard_map` over `axis`, a mesh)
    against a plain `lax.scan` of the same `combine`: values, gradient, tangent."""
    devices = 1 if axis is None else axis.devices.size
    steps = devices * rng.choice([1, 2, 3, 5, 7, 16, 31, 64, 100])
    combine, elems, part, rebuild = combine_problem(rng, g, steps)
    reverse = rng.random() < 0.4
    method = rng.choice(["associative", "sequential", "chunked"])
    size = rng.choice([None, 1, 2, 3, 8]) if method == "chunked" else None
    opts = dict(reverse=reverse, method=method, chunk_size=size)

    def reference(elems):
        flip = lambda e: jax.tree_util.tree_map(lambda x: x[::-1], e)
        elems = flip(elems) if reverse else elems
        head = jax.tree_util.tree_map(lambda x: x[0], elems)
        rest = jax.tree_util.tree_map(lambda x: x[1:], elems)
        _, ys = jax.lax.scan(lambda c, x: (combine(c, x),) * 2, head, rest)
        ys = jax.tree_util.tree_map(
            lambda h, y: jnp.concatenate([h[None], y]), head, ys
        )
        return flip(ys) if reverse else ys

    def scan(elems):
        if axis is None:
            return pscan.associative_scan(combine, elems, **opts)
        time_ = PartitionSpec("t")
        return jax.shard_map(
            lambda e: pscan.associative_scan(combine, e, axis_name="t", **opts),
            mesh=axis,
            in_specs=(time_,),
            out_specs=time_,
            check_vma=False,
        )(elems)

    found = {"values": gap(jax.jit(scan)(elems), jax.jit(reference)(elems))}
    x = part(elems)
    w = jax.tree_util.tree_map(lambda y: g.standard_normal(np.shape(y)), x)
    loss = lambda f: (
        lambda x: sum(
            jnp.sum(jnp.real(a * b))
            for a, b in zip(
                jax.tree_util.tree_leaves(w),
                jax.tree_util.tree_leaves(part(f(rebuild(elems, x)))),
            )
        )
    )
    found["gradient"] = gap(
        jax.jit(jax.grad(loss(scan)))(x), jax.jit(jax.grad(loss(reference)))(x)
    )
    t = jax.tree_util.tree_map(lambda y: np.cos(y).astype(y.dtype), x)
    jvp = lambda f: jax.jit(
        lambda x, t: jax.jvp(lambda x: part(f(rebuild(elems, x))), (x,), (t,))[1]
    )(x, t)
    found["tangent"] = gap(jvp(scan), jvp(reference))
    where = (
        f"T={steps} {combine.__name__} {jax.tree_util.tree_map(np.shape, elems)} {opts}"
    )
    return where, found, 1e-10 if X64 else 1e-4


def main(mode, seconds, seed0):
    mesh = lambda: Mesh(np.array(jax.devices()[: random.choice([2, 4])]), ("t",))
    check = {
        "recurrence": check_recurrence,
        "linear": check_linear,
        "layers": lambda rng, *a: (
            check_bidirectional if rng.random() < 0.25 else check_layers
        )(rng, *a),
        "associative": check_associative,
        "sharded": lambda *a: check_recurrence(*a, axis=mesh()),
        "sharded-linear": lambda *a: check_linear(*a, axis=mesh()),
        "sharded-associative": lambda *a: check_associative(*a, axis=mesh()),
    }[mode]
    end, count, bad = time.time() + seconds, 0, 0
    while time.time() < end:
        seed = seed0 + count
        count += 1
        random.seed(seed)
        rng, g = random.Random(seed), np.random.default_rng(seed)
        try:
            where, found, limit = check(rng, g, seed)
        except Exception as e:  # any failure is a finding
            bad += 1
            print(f"seed {seed}: raised {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        off = {k: v for k, v in found.items() if not v <= limit}
        if off:
            bad += 1
            print(f"seed {seed}: {where}: {off}", flush=True)
        if count % 20 == 0:
            jax.clear_caches()  # compiled programs add up
    print(f"{mode}: {count} configurations, {bad} off")
    return bad


if __name__ == "__main__":
    sys.exit(main(OPTIONS.mode, OPTIONS.seconds, OPTIONS.seed) > 0)
