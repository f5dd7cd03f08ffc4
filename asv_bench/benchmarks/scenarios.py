"""The benchmark scenarios, defined once: the asv suite (`linear.py`, `nonlinear.py`,
`seed.py`), the command-line tables (`asv_bench/tables.py`) and the GPU check
(`asv_bench/gpu_check.py`) all build their problems and programs here.

Every program is a function of arrays (or pytrees of them) ready for `jax.jit`.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

import pscan

# --------------------------------------------------------------------------------------
# Linear recurrence: h[t] = a[t] * h[t-1] + b[t], elementwise a.
# --------------------------------------------------------------------------------------


def linear_problem(length, channels, batch=None, dtype=jnp.float32):
    """`(a, b)` of shape `(T, [batch,] channels)`, `|a|` in `[0.5, 0.999)` (for a
    complex `dtype`, at a random angle)."""
    shape = (length, channels) if batch is None else (length, batch, channels)
    ka, kb, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    real = jnp.finfo(dtype).dtype
    a = jax.random.uniform(ka, shape, real, 0.5, 0.999)
    if jnp.issubdtype(dtype, jnp.complexfloating):  # as S5's diagonal: |a| < 1
        a = a * jnp.exp(1j * jax.random.uniform(kc, shape, real, 0, 2 * jnp.pi))
    b = jax.random.normal(kb, shape, dtype)
    return a.astype(dtype), b


def scan_linear(a, b):
    """The obvious `lax.scan` a user would write: the baseline."""

    def step(h, ab):
        h = ab[0] * h + ab[1]
        return h, h

    return lax.scan(step, jnp.zeros_like(b[0]), (a, b))[1]


def associative_linear(a, b):
    """The recurrence as a direct `lax.associative_scan` of the affine combine (as S5's
    code has it): the figure `linear_recurrence(method="associative")` must match."""

    def combine(earlier, later):
        return later[0] * earlier[0], later[0] * earlier[1] + later[1]

    return lax.associative_scan(combine, (a, b))[1]


def linear_forward(method):
    """`hs(a, b)` for a method name: `"lax.scan"`, `"lax.associative_scan"`, a
    `linear_recurrence` method, or `"chunked:C"` for a chunk size."""
    if method == "lax.scan":
        return scan_linear
    if method == "lax.associative_scan":
        return associative_linear
    method, _, chunk = method.partition(":")
    chunk_size = int(chunk) if chunk else None
    return lambda a, b: pscan.linear_recurrence(
        a, b, method=method, chunk_size=chunk_size
    )


def linear_programs(method):
    """`{"fwd": hs(a, b), "grad": d sum(|hs|^2) / d(a, b)}`."""
    fwd = linear_forward(method)

    def loss(a, b):
        hs = fwd(a, b)  # one call: a second would be a second recurrence to transpose
        return jnp.sum((hs * jnp.conj(hs)).real)

    grad = jax.grad(loss, argnums=(0, 1))
    return {"fwd": fwd, "grad": grad}


LINEAR_METHODS = ["lax.scan", "auto", "sequential", "chunked", "associative"]


# --------------------------------------------------------------------------------------
# Nonlinear solvers on a GRU cell 1 -> hidden.
# --------------------------------------------------------------------------------------


def gru_problem(length, hidden=32):
    """`(cell, xs, h0)`: a random `eqx.nn.GRUCell(1, hidden)` and `(T, 1)` inputs."""
    cell = eqx.nn.GRUCell(1, hidden, key=jax.random.PRNGKey(0))
    xs = jax.random.normal(jax.random.PRNGKey(1), (length, 1))
    return cell, xs, jnp.zeros(hidden)


def gru_solvers(chunk=256, tol=1e-5):
    """Every solver, by the name the tables print."""
    tol = dict(rtol=tol, atol=tol)
    return {
        "Sequential": pscan.Sequential(),
        f"Sequential(checkpoint={chunk})": pscan.Sequential(checkpoint=chunk),
        f"Picard(chunk_size={chunk})": pscan.Picard(chunk_size=chunk, **tol),
        f"Newton(chunk_size={chunk})": pscan.Newton(chunk_size=chunk, **tol),
        f"Newton(chunk_size={chunk}, diagonal)": pscan.Newton(
            chunk_size=chunk, jacobian="diagonal", **tol
        ),
        "Newton() = DEER": pscan.Newton(**tol),
        "Newton(diagonal) = quasi-DEER": pscan.Newton(jacobian="diagonal", **tol),
        f"ELK(chunk_size={chunk})": pscan.ELK(chunk_size=chunk, **tol),
    }


def solver_programs(solver, h0, throw=True):
    """`{"fwd": hs(cell, xs), "grad": d sum(hs) / d cell, "grad_sq": d sum(hs**2) /
    d cell, "solve": Solution}`: the states and gradients as a user runs them (the
    default `throw=True`, unless told), the `Solution` with `throw=False` to read its
    result."""
    hs = lambda c, xs: pscan.recurrence(c, xs, h0, solver=solver, throw=throw).hs
    grad = eqx.filter_grad(lambda c, xs: jnp.sum(hs(c, xs)))
    grad_sq = eqx.filter_grad(lambda c, xs: jnp.sum(hs(c, xs) ** 2))
    return {
        "fwd": hs,
        "grad": lambda c, xs: grad(c, xs),  # jit cannot hash filter_grad's wrapper
        "grad_sq": lambda c, xs: grad_sq(c, xs),
        "solve": lambda c, xs: pscan.recurrence(c, xs, h0, solver=solver, throw=False),
    }


def deer_reference(cell, xs, h0, iterations, atol=None):
    """DEER as its authors' `seq1d` runs it (Lim et al. 2024), for comparison: every
    iteration takes `vmap(jacfwd(cell))` at the shifted states, solves the linearised
    recurrence with `lax.associative_scan` over dense `(d, d)` coefficients and clips
    the new states to +-1e8. Without `atol`, runs exactly `iterations` iterations (to
    compare time per iteration) and returns the states; with it, stops when no state
    moved by more than `atol` (at most `iterations`) and returns
    `(states, iterations run)`."""
    step = lambda h, x: cell(x, h)
    jac = jax.vmap(jax.jacfwd(step))

    def combine(earlier, later):
        a1, b1 = earlier
        a2, b2 = later
        return a2 @ a1, jnp.einsum("...ij,...j->...i", a2, b1) + b2

    def iteration(hs):
        prev = jnp.concatenate([h0[None], hs[:-1]])
        a = jac(prev, xs)
        b = jax.vmap(step)(prev, xs) - jnp.einsum("tij,tj->ti", a, prev)
        b = b.at[0].add(a[0] @ h0)  # h[-1] = h0 is known: fold it into b[0]
        a = a.at[0].set(0)
        _, new = lax.associative_scan(combine, (a, b))
        return jnp.nan_to_num(jnp.clip(new, -1e8, 1e8))

    hs = jnp.broadcast_to(h0, (xs.shape[0], h0.shape[0]))
    if atol is None:
        return lax.fori_loop(0, iterations, lambda _, hs: iteration(hs), hs)

    def body(carry):
        hs, it, _ = carry
        new = iteration(hs)
        return new, it + 1, jnp.max(jnp.abs(new - hs))

    def cond(carry):
        return (carry[1] < iterations) & (carry[2] > atol)

    hs, it, _ = lax.while_loop(cond, body, (hs, 0, jnp.array(jnp.inf, hs.dtype)))
    return hs, it


class ARGRU(eqx.Module):
    """A chaotic autoregressive GRU (as in the ELK paper's set-up): the readout of the
    state is fed back as the next input, plus a small drive `x`; `gain` scales the
    recurrent weights."""

    gru: eqx.nn.GRUCell
    readout: jax.Array

    def __init__(self, hidden, gain, readout_gain, key, dtype=jnp.float32):
        k1, k2 = jax.random.split(key)
        gru = eqx.nn.GRUCell(1, hidden, key=k1, dtype=dtype)
        self.gru = eqx.tree_at(lambda g: g.weight_hh, gru, gru.weight_hh * gain)
        scale = readout_gain / hidden**0.5
        self.readout = scale * jax.random.normal(k2, (hidden,), dtype)

    def __call__(self, x, h):
        return self.gru(jnp.reshape(self.readout @ h + x, (1,)), h)


def ar_gru_problem(length, hidden, gain, readout_gain, seed, dtype=jnp.float32):
    """`(cell, xs, h0)` of a chaotic autoregressive GRU driven by small noise."""
    cell = ARGRU(hidden, gain, readout_gain, jax.random.PRNGKey(seed), dtype)
    xs = 0.01 * jax.random.normal(jax.random.PRNGKey(9), (length, 1), dtype)
    return cell, xs, jnp.zeros(hidden, dtype)


# `(hidden, gain, readout gain, seed)` of the two chaotic cells the tables use
AR_GRU_CONFIGS = [(8, 10.0, 3.0, 0), (16, 5.0, 5.0, 1)]
# a milder one (smaller gains): DEER needs about 250 iterations at T = 2000, not T
MILD_AR_GRU_CONFIG = (16, 3.5, 3.5, 2)


def chaos_solvers(length, atol):
    """The solvers of the chaotic-cell comparison: every one stops when no state moved
    by more than `atol` (`rtol=0`), after at most `length + 1` iterations."""
    tol = dict(rtol=0.0, atol=atol, max_iters=length + 1)
    return {
        "Newton() = DEER": pscan.Newton(**tol),
        "Newton(diagonal) = quasi-DEER": pscan.Newton(jacobian="diagonal", **tol),
        "Newton(chunk_size=16)": pscan.Newton(chunk_size=16, **tol),
        "Newton(chunk_size=16, damping=0.5)": pscan.Newton(
            chunk_size=16, damping=0.5, **tol
        ),
        "ELK()": pscan.ELK(**tol),
        "ELK(diagonal) = quasi-ELK": pscan.ELK(jacobian="diagonal", **tol),
        "ELK(chunk_size=16)": pscan.ELK(chunk_size=16, **tol),
    }


def cell_residual(cell, xs, h0, hs):
    """`max |h[t] - cell(x[t], h[t-1])|`: how far `hs` is from solving the recurrence
    (for chaotic cells, where two exact trajectories part after a few steps), the
    cell's products at full precision (a TPU's default rounds them to about 1e-2
    here, whatever `hs`)."""
    prev = jnp.concatenate([h0[None], hs[:-1]])
    with jax.default_matmul_precision("highest"):
        return float(jnp.max(jnp.abs(hs - jax.vmap(cell)(xs, prev))))


# --------------------------------------------------------------------------------------
# The seed scenario: Elman width -> width over a batch, gradient of sum(hs) wrt the cell.
# --------------------------------------------------------------------------------------


def elman_problem(length, batch=16, width=32):
    """`(cell, xs)`: a `pscan.nn.ElmanCell(width, width)` with contractive recurrent
    weights, and inputs `(batch, T, width)`."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    cell = pscan.nn.ElmanCell(width, width, key=k1, dtype=jnp.float32)
    cell = eqx.tree_at(
        lambda c: (c.weight_ih, c.weight_hh, c.bias),
        cell,
        (
            jax.random.normal(k1, (width, width)) / width**0.5,
            0.9 * jax.random.normal(k2, (width, width)) / width**0.5,
            jnp.zeros(width),
        ),
    )
    xs = jax.random.normal(k3, (batch, length, width))
    return cell, xs


class Unsplit(eqx.Module):
    """A cell seen only as `cell(x, h)`: pscan cannot hoist its input projection."""

    cell: eqx.Module

    def __call__(self, x, h):
        return self.cell(x, h)


def scan_elman(cell, xs):
    """`sum(hs)` by a hand-written `lax.scan` of the cell, vmapped: the baseline."""

    def one(xs):
        def step(h, x):
            h = cell(x, h)
            return h, h

        return lax.scan(step, cell.init_state(), xs)[1]

    return jnp.sum(jax.vmap(one)(xs))


def seed_programs(every=None):
    """Gradients of `sum(hs)` wrt the cell: the `lax.scan` baseline, the
    `pscan.nn.Recurrence` layer with its default solver, and (with `every`)
    `Sequential(checkpoint=every)` on the cell seen only as `cell(x, h)`."""

    def layer(cell, xs):
        return jnp.sum(jax.vmap(pscan.nn.Recurrence(cell))(xs))

    programs = {
        "lax.scan": jax.grad(scan_elman),
        "pscan.nn.Recurrence": jax.grad(layer),
    }
    if every is not None:

        def unsplit(cell, xs):
            solver = pscan.Sequential(checkpoint=every)
            h0 = cell.init_state()
            one = lambda xs: pscan.recurrence(Unsplit(cell), xs, h0, solver=solver).hs
            return jnp.sum(jax.vmap(one)(xs))

        programs[f"Sequential(checkpoint={every}), unsplit cell"] = jax.grad(unsplit)
    return programs


# --------------------------------------------------------------------------------------
# Sequences as users have them: a batch of series of different lengths.
# --------------------------------------------------------------------------------------


def packed_problem(total=2**19, count=16, hidden=32, shortest=1000, seed=0):
    """`(cell, xs, h0, lengths)`: a random `eqx.nn.GRUCell(1, hidden)` and `count`
    series of lengths drawn between `shortest` and `64 * shortest` (then scaled to add
    up to about `total`), packed end to end in `xs` `(T, 1)`."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(shortest), np.log(64 * shortest), count))
    sizes = np.clip(sizes * total / sizes.sum(), 1, None).astype(int)
    cell = eqx.nn.GRUCell(1, hidden, key=jax.random.PRNGKey(0))
    xs = jax.random.normal(jax.random.PRNGKey(1), (int(sizes.sum()), 1))
    return cell, xs, jnp.zeros(hidden), [int(n) for n in sizes]


def packed_programs(solver, h0, lengths, throw=True):
    """Three ways to run a batch of series of different `lengths` (packed end to end
    in `xs`), each `{"fwd": hs, "grad": d sum(hs) / d cell, "solve": Solution}`:

    - `packed`: one call with `resets` at the series' starts;
    - `one by one`: one call per series, in one program;
    - `padded`: the series right-padded to the longest, `jax.vmap` with `length`.

    Every call with `throw` (`pscan.recurrence`'s default: what users run).
    """
    starts = np.cumsum([0, *lengths[:-1]])
    resets = np.zeros(sum(lengths), bool)
    resets[starts] = True
    longest = max(lengths)
    solve = lambda c, xs, **kw: pscan.recurrence(
        c, xs, h0, solver=solver, throw=throw, **kw
    )

    def one_by_one(c, xs):
        sols = [solve(c, xs[s : s + n]) for s, n in zip(starts, lengths)]
        return pscan.Solution(
            hs=jnp.concatenate([s.hs for s in sols]),
            result=sols[0].result,
            stats={
                "num_iterations": jnp.max(
                    jnp.stack([s.stats["num_iterations"] for s in sols])
                )
            },
        )

    def padded(c, xs):
        rows = [
            jnp.pad(xs[s : s + n], ((0, longest - n), (0, 0)))
            for s, n in zip(starts, lengths)
        ]
        sol = jax.vmap(lambda x, n: solve(c, x, length=n))(
            jnp.stack(rows), jnp.array(lengths)
        )
        hs = jnp.concatenate([h[:n] for h, n in zip(sol.hs, lengths)])
        iterations = jnp.max(sol.stats["num_iterations"])
        return pscan.Solution(hs, sol.result, {"num_iterations": iterations})

    ways = {
        "packed (resets)": lambda c, xs: solve(c, xs, resets=resets),
        "one by one": one_by_one,
        "padded (vmap, length)": padded,
    }
    programs = {}
    for name, way in ways.items():
        grad = eqx.filter_grad(lambda c, xs, way=way: jnp.sum(way(c, xs).hs))
        programs[name] = {
            "fwd": lambda c, xs, way=way: way(c, xs).hs,
            "grad": lambda c, xs, grad=grad: grad(c, xs),
            "solve": way,
        }
    return programs
