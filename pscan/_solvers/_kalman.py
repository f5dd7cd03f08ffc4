"""The Kalman filter and Rauch-Tung-Striebel smoother of ELK's damped step, in
parallel (Särkkä and García-Fernández 2021): associative filtering and smoothing
elements scanned by `pscan.associative_scan`, or the classic filter and smoother
steps in a loop, on dense `(d, d)` or diagonal `(d,)` dynamics."""

import jax.lax as lax
import jax.numpy as jnp

from .._associative import scan_elements
from .._axis import global_rows, shift_backward, shift_forward
from .._blocks import block_matmul, block_solve, block_solve_spd
from ._jacobian import DenseJacobian, DiagonalJacobian

_HIGHEST = lax.Precision.HIGHEST


class _Dense:
    """Matrix algebra on `(..., d, d)` blocks."""

    mm = staticmethod(block_matmul)

    @staticmethod
    def mv(a, v):
        return jnp.einsum("...ij,...j->...i", a, v, precision=_HIGHEST)

    @staticmethod
    def t(a):
        return jnp.swapaxes(a, -1, -2)

    @staticmethod
    def eye(like):
        return jnp.broadcast_to(jnp.eye(like.shape[-1], dtype=like.dtype), like.shape)

    @staticmethod
    def solve(m, b):  # m^{-1} b, b a matrix
        return block_solve(m, b)

    @staticmethod
    def solve_spd(m, b):  # m^{-1} b, m symmetric positive definite
        return block_solve_spd(m, b)

    @staticmethod
    def solve_three(m, a, c, v):  # m^{-1} a, m^{-1} c, m^{-1} v: one factorisation
        d = a.shape[-1]
        x = block_solve(m, jnp.concatenate([a, c, v[..., None]], axis=-1))
        return x[..., :d], x[..., d : 2 * d], x[..., 2 * d]

    @staticmethod
    def solve_spd_two(m, c, v):  # m^{-1} c, m^{-1} v, m as in `solve_spd`: one factor
        x = block_solve_spd(m, jnp.concatenate([c, v[..., None]], axis=-1))
        return x[..., :-1], x[..., -1]

    @staticmethod
    def symmetric(a):  # the symmetric part, (a + a^T) / 2
        return 0.5 * (a + jnp.swapaxes(a, -1, -2))


class _Diagonal:
    """The same algebra on diagonals `(..., d)`: every operation elementwise."""

    mm = staticmethod(lambda a, b: a * b)
    mv = staticmethod(lambda a, v: a * v)
    t = staticmethod(lambda a: a)
    eye = staticmethod(jnp.ones_like)
    solve = staticmethod(lambda m, b: b / m)
    solve_spd = solve
    solve_three = staticmethod(lambda m, a, c, v: (a / m, c / m, v / m))
    solve_spd_two = staticmethod(lambda m, c, v: (c / m, v / m))
    symmetric = staticmethod(lambda a: a)


# the Kalman smoother's algebra for each Jacobian structure
ALGEBRA = {DenseJacobian: _Dense, DiagonalJacobian: _Diagonal}


def _row(k, x):
    """A per-row value `k` `(K,)` shaped to broadcast against `x` `(K, ...)`."""
    return k.reshape(k.shape + (1,) * (x.ndim - 1))


def _elements(alg, f, u, y, kappa, implied, first):
    """The associative filtering elements `(A, b, C, eta, J)` of every row (Särkkä and
    García-Fernández 2021), from each row's dynamics `f`, `u` (zero before the
    sequence's first row, whose element is then `(0, h0, 0, 0, 0)`); the second row's
    (`first`, its previous row h0 known exactly) from its prior `implied`."""
    a = jnp.where(_row(first, f), 0, _row(1 - kappa, f) * f)
    b = jnp.where(
        _row(first, u),
        implied + _row(kappa, y) * (y - implied),
        u + _row(kappa, u) * (y - u),
    )
    c = _row(1 - kappa, f) * alg.eye(f)
    eta = jnp.where(_row(first, u), 0, _row(kappa, u) * alg.mv(alg.t(f), y - u))
    # J^T J of each row's dynamics, from the shifted Jacobians behind an optimization
    # barrier: XLA TPU fused the shift (a concatenate) into the batched product and
    # ran its blocks one after another (v5e, K = 10000, d = 16, full precision:
    # 475 ms against 1 ms for the product of an unshifted array; 35 s to compile).
    # On CPU the barrier changes nothing, bit for bit
    fb = lax.optimization_barrier(f)
    jj = jnp.where(_row(first, f), 0, _row(kappa, f) * alg.mm(alg.t(fb), fb))
    return a, b, c, eta, jj


def _combine(alg):
    """The associative combine of two filtering elements, `e1` earlier in time."""

    def combine(e1, e2):
        a1, b1, c1, eta1, j1 = e1
        a2, b2, c2, eta2, j2 = e2
        m = alg.eye(c1) + alg.mm(c1, j2)
        # (I + C1 J2)^{-1} applied to A1, C1 and b1 + C1 eta2; the transpose of
        # w = (I + C1 J2)^{-1} A1 is A1^T (I + J2 C1)^{-1}
        w, mc, mb = alg.solve_three(m, a1, c1, b1 + alg.mv(c1, eta2))
        a12 = alg.mm(a2, w)
        b12 = alg.mv(a2, mb) + b2
        c12 = alg.mm(alg.mm(a2, mc), alg.t(a2)) + c2
        eta12 = alg.mv(alg.t(w), eta2 - alg.mv(j2, b1)) + eta1
        j12 = alg.mm(alg.mm(alg.t(w), j2), a1) + j1
        return a12, b12, c12, eta12, j12

    return combine


def _filtered(alg, f, u, y, kappa):
    """`(means, covariances)` of the classic Kalman filter, one row after another
    from before the first (whose dynamics `f`, `u` are zero and which is known
    exactly: it is `h0`, its covariance 0). Row k: the prediction `P = F P F^T + I`,
    `m = F m + u`, then the update by `y[k]` with variance `(1 - kappa) / kappa`,
    through `S = kappa P + (1 - kappa) I`, symmetric positive definite (Cholesky; the
    associative combine's `I + C J` is not, and takes LU): the gain is `kappa P
    S^{-1}`. Against that combine's prefix-by-row form in a loop of K = 10000 rows,
    d = 16, CPU: 38 against 51-54 ms, compiled in 0.20 against 0.23-0.26 s."""
    eye = alg.eye(f[0])

    def step(carry, row):
        mean, cov = carry
        fk, uk, yk, kk = row
        prior = alg.mm(alg.mm(fk, cov), alg.t(fk)) + eye
        mean = alg.mv(fk, mean) + uk
        weighted = kk * prior
        gain_t, innovation = alg.solve_spd_two(
            weighted + (1 - kk) * eye, weighted, kk * (yk - mean)
        )
        # the symmetric part: rounding would otherwise drift it from symmetric
        cov = alg.symmetric(prior - alg.mm(prior, gain_t))
        mean = mean + alg.mv(prior, innovation)
        return (mean, cov), (mean, cov)

    init = (jnp.zeros_like(u[0]), jnp.zeros_like(eye))
    return lax.scan(step, init, (f, u, y, kappa))[1]


def kalman(
    alg, jac, ends, starts, implied, y, kappa, method, chunk_size, smooth, axis_name
):
    """The Levenberg-Marquardt step as the posterior mean of a linear-Gaussian
    state-space model, by a parallel Kalman filter and (`smooth=True`)
    Rauch-Tung-Striebel smoother (Särkkä and García-Fernández 2021). Without the
    smoother, row `k` is the filter's mean: the trust-region step of the rows up to
    `k` alone, blind to the rows after it (as Newton's step is).

    One row per chunk start `x_k` (with `axis_name`, this device's block of them):
    dynamics `x_{k+1} = J_k x_k + c_k + w_k`, `w_k ~ N(0, I)`, `c_k = F_k(s_k) - J_k
    s_k`; observations `y[k]` with variance `sigma2_k`, given as `kappa[k] = 1 / (1 +
    sigma2_k)` (1: the row is known exactly). The first row of the sequence is `h0`,
    known exactly (`kappa = 1`, `y = h0`); the second has the prior `F_0(h0)` with
    covariance I.

    **Arguments:**

    - `alg`: the algebra of the Jacobians' structure (`ALGEBRA[structure]`).
    - `jac`: `J_k`, `(K, d, d)` or `(K, d)` (the last row's unused).
    - `ends`: `F_k(s_k)`, each chunk's end from its start, `(K, d)`.
    - `starts`: the chunk starts `s_k`, `(K, d)`.
    - `implied`: the previous chunk's end (`ends` shifted one row forward; `h0`
        on the first row), `(K, d)`.
    - `y`: the observations, `(K, d)`.
    - `kappa`: `1 / (1 + sigma2_k)`, `(K,)`.
    - `method`, `chunk_size`: how the filter and smoother scan the rows, as
        `pscan.associative_scan` does (`"sequential"` without `axis_name`: the
        classic filter and smoother steps in a loop).
    - `smooth`: whether to smooth (else the filter's means).
    - `axis_name`: None, or the mesh axis that splits the rows over devices.

    **Returns:**

    The step, `(K, d)` (`h0` on the sequence's first row).
    """
    index, total = global_rows(starts.shape[0], axis_name)
    # each row's dynamics from the row before it, J_{k-1} and c_{k-1} (zero before
    # the first row, whose element is then (0, h0, 0, 0, 0))
    before = lambda x: shift_forward(x, jnp.zeros_like(x[0]), axis_name)
    f = before(jac)
    u = before(ends) - alg.mv(f, before(starts))
    # a loop over the whole sequence (no `axis_name`: no other device's rows before
    # these) runs from its first row, and back from its last
    from_start = method == "sequential" and axis_name is None
    scan = lambda combine, elements, reverse: scan_elements(
        combine, elements, reverse, method, chunk_size, axis_name
    )
    if from_start:
        means, covs = _filtered(alg, f, u, y, kappa)
    else:
        elements = _elements(alg, f, u, y, kappa, implied, index == 1)
        means, covs = scan(_combine(alg), elements, False)[1:3]
    if not smooth:
        return means
    # smoothing elements (E, g) for every row but the last, from its own dynamics
    # (the first row's is (0, h0): its covariance is 0); the last row's is (0, m)
    pf = alg.mm(jac, covs)  # F P
    gain = alg.t(
        alg.solve_spd(alg.mm(pf, alg.t(jac)) + alg.eye(covs), pf)
    )  # P F^T (F P F^T + I)^-1, F P F^T + I >= I
    last = index == total - 1
    e = jnp.where(_row(last, gain), 0, gain)
    own = shift_backward(u, axis_name)  # c_k
    g = jnp.where(
        _row(last, means), means, means - alg.mv(gain, alg.mv(jac, means) + own)
    )

    def compose(later, earlier):  # x_k = E_k x_{k+1} + g_k, applied backward in time
        e2, g2 = later
        e1, g1 = earlier
        return alg.mm(e1, e2), alg.mv(e1, g2) + g1

    def backward_step(later, earlier):
        # `compose` where `later` runs to the last row, whose E is zero: so is the
        # product, and what is left is the classic smoother's backward step
        return later[0], alg.mv(earlier[0], later[1]) + earlier[1]

    # from the last element back: a reverse scan, whose "earlier" is the later step
    _, smoothed = scan(backward_step if from_start else compose, (e, g), True)
    return smoothed
