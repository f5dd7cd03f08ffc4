"""ELK: Newton with a Levenberg-Marquardt trust region, its step a Kalman filter or
smoother."""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from .._associative import SCAN_METHODS, auto_method
from .._axis import everywhere, global_rows, shift_forward
from .._finite import all_along, finite_along
from .._precision import check_precision, separate_jacobian_precision
from ._base import as_python
from ._jacobian import STRUCTURES
from ._kalman import ALGEBRA, kalman
from ._newton import newton_starts
from ._shooting import AbstractShootingSolver


def _leading(solved, axis_name):
    """The number of leading `True`s along the last axis over the whole sequence
    (across the devices of `axis_name`): the index of the first `False` (one
    reduction; a cumulative product compiles to a tree of several)."""
    index, total = global_rows(solved.shape[-1], axis_name)
    front = jnp.min(jnp.where(solved, total, index), axis=-1)
    return everywhere(front, axis_name, lax.pmin)


class ELK(AbstractShootingSolver):
    """ELK: Newton on the chunk starts with a Levenberg-Marquardt trust region whose
    damped step is solved exactly, in parallel, by a Kalman filter or smoother
    (Gonzalez et al., NeurIPS 2024), with a trust radius that adapts from step to step.

    The damped step minimises the linearised residual `sum_k |s[k+1] - F_k(s_k) -
    J_k (s_new[k] - s_k)|^2` plus `(1 / radius) sum_k |s_new[k] - s_k|^2`: the
    posterior mean of a linear-Gaussian model (dynamics `J_k`, observations the
    current starts with variance `radius`). The smoother gives that minimiser over the
    whole sequence (the ELK paper's step); the filter gives each row the minimiser of
    the rows up to it, blind to the rows after it as Newton's step is, so that the
    runaway rows far ahead of the converged prefix (chaotic cells) do not pull the
    rows near it back. `radius -> inf` is Newton (DEER at `chunk_size=1`);
    `jacobian="diagonal"` is quasi-ELK (memory `O(K d)`).

    Each iteration evaluates two candidates in one sweep, the damped step and Newton's
    full step, and takes the one whose leading chunk starts solve the recurrence
    within the tolerances further, then the one with the smaller sum of squared
    residuals (alone, that sum is no measure of progress on chaotic cells: the rows
    that ran away dominate it). Past the front of a Newton step that wins, its starts
    that solve worse than the damped step's are the damped step's: Newton's run away
    there, the damped step's do not. With the dense Jacobian the radius grows 4x when
    Newton's step wins and shrinks 4x when the damped one solves strictly further;
    with the diagonal one (whose damped step stays useful far from the quasi-Newton
    step) it stays where it started, as in the ELK paper. `stats["radius"]` is where
    it ended.

    On the tables' AR-GRUs (`python asv_bench/tables.py chaos`, T = 2000, float32)
    ELK needs 9 iterations where DEER needs 249 on a milder cell, and about as many
    as DEER on two strongly chaotic ones (over five drives, 1439 vs 1536 and 573 vs
    571 on average); quasi-ELK 202 and 1351 where quasi-DEER needs 1974 and 1961; no
    iterate of either reaches the float bound. The gradient is implicit and exact
    (the fixed point is the sequential answer).

    An iteration costs more than Newton's: two candidate sweeps, the states' check
    (one more sweep at `chunk_size=1`, one step per chunk otherwise), and a Kalman
    filter besides Newton's linear solve (with `d x d` solves in every combine when
    dense: at `chunk_size=1` 7-17x DEER's time per iteration on CPU, 2-3x on a TPU
    v5e, where quasi-ELK's costs about quasi-DEER's).

    **Arguments:**

    - `chunk_size`: steps per chunk (`1`: every step is an unknown, as in DEER).
    - `jacobian`: `"dense"` or `"diagonal"`.
    - `radius`: the first trust radius (`sigma^2`, the observations' variance);
        None: `1e4` with the dense Jacobian, `10` with the diagonal one.
    - `adapt`: whether the radius adapts; None: with the dense Jacobian only.
    - `kalman`: the damped step, `"filter"` or `"smoother"`; None: the filter at
        `chunk_size=1`, the smoother for longer chunks (which measured better there:
        6 against 56 iterations on the milder cell at `chunk_size=16`).
    - `max_iters`: the most steps.
    - `rtol`, `atol`: converged when every chunk start `s[k]` solves the recurrence
        within `atol + rtol * |s[k]|` (its residual `s[k] - F_{k-1}(s[k-1])`), and so
        does the state after it (the chunk's first step from `s[k]` against from
        `F_{k-1}(s[k-1])`: a step can amplify a residual). A residual is not an
        error: on a cell that amplifies perturbations the states can be further from
        the sequential ones (on the milder AR-GRU at T = 500, `atol=1e-5`: 1.2e-5 for
        ELK, 1.7e-4 for quasi-ELK, where DEER's test on the change gives 6e-7).
    - `fallback`: `None`, or `"sequential"` to return the exact sequential solution
        (and flag `stats["fell_back"]`) when not converged.
    - `method`: how the Kalman filter and smoother scan the chunks, as
        `pscan.associative_scan` does: `"sequential"`, `"associative"`, `"chunked"`,
        or `"auto"` (as `pscan.linear_recurrence` chooses for `K` steps: sequential
        on CPU and up to 2048 chunks on a TPU, chunked otherwise; with the dense
        Jacobian chunked on a TPU whatever `K`, as its combine solves `d x d`
        systems, in chunks of about `sqrt(K) / 3` rows, 16 to 64).
    - `axis_name`: inside `shard_map`, the mesh axis that splits time (each device
        holds a block of consecutive steps, a multiple of `chunk_size`): the Kalman
        filter and smoother, Newton's step and the candidates' merits run across the
        devices, as `pscan.Newton`'s solve does. See `pscan.sharded_recurrence`.
    - `precision`: the precision of the cell's float32 matrix products while it
        solves, `"highest"` by default (see `pscan.Newton`: at a TPU's default
        precision ELK took 498 iterations instead of 10 on a mildly chaotic cell at
        T = 500); None: the caller's.
    - `jacobian_precision`: None by default: the Jacobians at `precision`, from the
        forward-mode pass that runs the chunks. A precision (`"default"`): the
        Jacobians apart at that one, as `pscan.Newton` builds them by default. ELK's
        Kalman step leans on them harder than Newton's: on a TPU v5e, at T = 500,
        the most chaotic cell of the benchmarks took 449 iterations instead of 372
        (`ELK(chunk_size=16)` on the second: 30 instead of 26), for 1.14x the speed
        of `ELK(chunk_size=128)` on a contractive GRU.
    """

    chunk_size: int = eqx.field(static=True, default=1, converter=as_python)
    jacobian: str = eqx.field(static=True, default="dense")
    radius: float | None = eqx.field(static=True, default=None, converter=as_python)
    adapt: bool | None = eqx.field(static=True, default=None)
    kalman: str | None = eqx.field(static=True, default=None)
    max_iters: int = eqx.field(static=True, default=100, converter=as_python)
    rtol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    atol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    fallback: str | None = eqx.field(static=True, default=None)
    method: str = eqx.field(static=True, default="auto")
    axis_name: str | None = eqx.field(static=True, default=None)
    precision: str | None = eqx.field(static=True, default="highest")
    jacobian_precision: str | None = eqx.field(static=True, default=None)
    name: ClassVar[str] = "ELK"

    def __check_init__(self):
        if self.jacobian not in STRUCTURES:
            raise ValueError(
                f"pscan.ELK: `jacobian` must be 'dense' or 'diagonal', got {self.jacobian!r}"
            )
        r = self.radius
        if r is not None and (
            isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0
        ):
            raise ValueError(
                f"pscan.ELK: `radius` must be None or a positive number, got {r!r}"
            )
        if self.adapt is not None and not isinstance(self.adapt, (bool, np.bool_)):
            raise ValueError(
                f"pscan.ELK: `adapt` must be None, True or False, got {self.adapt!r}"
            )
        if self.kalman not in (None, "filter", "smoother"):
            raise ValueError(
                "pscan.ELK: `kalman` must be None, 'filter' or 'smoother', got "
                f"{self.kalman!r}"
            )
        if self.method not in ("auto", *SCAN_METHODS):
            raise ValueError(
                f"pscan.ELK: `method` must be one of {('auto', *SCAN_METHODS)}, got "
                f"{self.method!r}"
            )
        check_precision("ELK", self.precision)
        check_precision("ELK", self.jacobian_precision, "jacobian_precision")

    def matrix_precision(self):
        return self.precision

    def jacobian_matrix_precision(self):
        return separate_jacobian_precision(self.precision, self.jacobian_precision)

    def linearisation(self):
        return STRUCTURES[self.jacobian]

    @property
    def _exact_newton(self):
        # whether the full step is Newton's (dense Jacobians) or quasi-Newton's
        return self.jacobian == "dense"

    @property
    def _adapts(self):
        # Newton's step is the one to grow towards; a quasi-Newton step is not, and
        # the damped step is the useful one far from it (quasi-ELK at a fixed radius)
        return self._exact_newton if self.adapt is None else self.adapt

    @property
    def _smoother(self):
        if self.kalman is None:
            return self.chunk_size > 1
        return self.kalman == "smoother"

    def _scan_method(self, chunks: int) -> tuple[str, int | None]:
        """How the Kalman scans run over `chunks` rows: `(method, chunk_size)`."""
        dense_tpu = self._exact_newton and jax.default_backend() == "tpu"
        method = self.method
        if method == "auto":
            # a dense combine solves `d x d` systems: a step of a loop over it costs
            # about 16 us on a TPU (DEER's linear recurrence 0.4 us), so there it is
            # chunked
            method = "chunked" if dense_tpu else auto_method(chunks)
        if method != "chunked" or not dense_tpu:
            return method, None
        # chunks of about sqrt(K) / 3 rows (a power of 2 in 16..64): the dense filter's
        # time on a TPU v5e is its sequential depth at small K and its work at large
        # K (d = 16, ms, C = 8 / 16 / 32 / 64 / 128: K = 500 1.4 / 1.9 / - / - / 8.4;
        # K = 2000 2.8 / 2.4 / 3.2 / 5.0 / 10.4; K = 10000 12.8 / 10.8 / 10.0 / 12.4
        # / 13.3; K = 50000 - / - / 49.9 / 46.3 / 51.7). The combines of the K / C
        # chunks run at once, their temporaries about 2 / C of the filter's elements:
        # hence at least 16
        size = 2 ** round(math.log2(max(1.0, math.sqrt(chunks) / 3)))
        return method, min(64, max(16, size))

    def init(self, chunks, starts):
        real = starts.real.dtype
        radius = self.radius
        if radius is None:
            radius = 1e4 if self._exact_newton else 10.0
        return {"radius": jnp.asarray(radius, real), "unsolved": jnp.array(True)}

    def unfinished(self, state):
        return state["unsolved"]

    def statistics(self, state):
        return {"radius": state["radius"]}

    def _within(self, starts, residual):
        """Per chunk start: whether its residual is within the tolerances."""
        scale = self.atol + self.rtol * jnp.abs(starts)
        return all_along(jnp.abs(residual) <= scale, axis=-1)  # NaN: not within

    def step(self, chunks, starts, state):
        axis = chunks.axis_name
        index, total = global_rows(starts.shape[0], axis)
        if total == 1:  # one chunk: its start is h0, nothing to solve
            return starts, {**state, "unsolved": jnp.array(False)}, None
        structure = self.linearisation()
        alg = ALGEBRA[structure]
        radius = state["radius"]
        # the chunk ends come with the Jacobians, from one forward-mode pass (or
        # apart from them, the Jacobians at a precision of their own)
        ends, operator = chunks.ends_and_linearise(
            structure, starts, self.jacobian_matrix_precision()
        )
        implied = chunks.shift(ends)  # the starts that the current ends imply
        # the leading starts that already solve the recurrence within the tolerances
        # (their own residual, and that of the states they give: the first step of
        # their chunk from them against from the previous chunk's end, which a step
        # of the cell can amplify) are kept exactly, and the first one after them
        # becomes exact (the end of an exact chunk): observed with variance 0. So the
        # exact prefix only grows, and `ceil(T / chunk_size)` steps always reach the
        # answer, as for Newton and Picard; the trust region acts on the rest
        residual = starts - implied  # row 0 is h0 - h0
        firsts = ends if self.chunk_size == 1 else chunks.first_steps(starts)
        states_residual = firsts - chunks.first_steps(implied)
        solved = self._within(starts, residual) & self._within(firsts, states_residual)
        exact = index < _leading(solved, axis)  # h0's row always
        after_exact = ~exact & shift_forward(exact, jnp.array(True), axis)
        known = exact | after_exact
        y = jnp.where(after_exact[:, None], implied, starts)
        kappa = jnp.where(known, 1.0, 1 / (1 + radius)).astype(radius.dtype)
        method, scan_chunk = self._scan_method(len(starts))
        steps = kalman(
            alg,
            operator.coefficients(),
            ends,
            starts,
            implied,
            y,
            kappa,
            method,
            scan_chunk,
            self._smoother,
            axis,
        )
        # the rows observed exactly are their observations, bit for bit: in floating
        # point the gain at a known row is not exactly zero, and times a later row
        # held at the bound (chaotic cells) it would undo the exact prefix
        damped = jnp.where(known[:, None], y, steps)
        # the full Newton step (the trust region's unconstrained minimiser), and the
        # damped step, evaluated together (one sweep of twice the width). Newton's
        # step refines the exact prefix (quadratically, which chaotic cells need:
        # pinned there, ELK took 1613 iterations instead of 569 on the tables'
        # second AR-GRU); a quasi-Newton step could undo it, so its known rows are
        # pinned as the damped step's are
        newton = newton_starts(chunks, starts, ends, operator)
        if not self._exact_newton:
            newton = jnp.where(known[:, None], y, newton)
        both = jnp.stack([damped, newton])
        both_ends = jax.vmap(chunks.ends)(both)
        both_residual = both - jax.vmap(chunks.shift)(both_ends)
        # how many leading starts each candidate solves
        fronts = _leading(self._within(both, both_residual), axis)
        further = jnp.sign(fronts[1] - fronts[0])  # +1: Newton's step solves further
        rows = jnp.sum(jnp.abs(both_residual) ** 2, axis=-1)  # (2, K)
        squares = everywhere(jnp.sum(rows, axis=-1), axis, lax.psum)
        squares = jnp.where(jnp.isfinite(squares), squares, jnp.inf)
        take_newton = (further > 0) | ((further == 0) & (squares[1] < squares[0]))
        if self._adapts:
            factor = jnp.where(take_newton, 4.0, jnp.where(further < 0, 0.25, 1.0))
            radius = jnp.clip(radius * factor, 1e-6, 1e12).astype(radius.dtype)
        new = jnp.where(take_newton, newton, damped)
        # past the front of Newton's step (and one more start), its starts that solve
        # the recurrence worse than the damped step's are the damped step's: there
        # Newton's run away (chaotic cells), while the trust region holds its own
        front = jnp.where(take_newton, fronts[1], fronts[0])
        worse = ~(rows[1] <= rows[0])  # NaN: worse
        ahead = (index > front + 1) & worse
        new = jnp.where(ahead[:, None], damped, new)
        # converged once every start solves the recurrence within the tolerances (a
        # short step, at a small radius, is no sign of convergence): those starts are
        # returned unchanged. Rows that are not finite follow non-finite data: they
        # are returned non-finite, for the loop to hold them as such
        finite_rows = finite_along(residual + states_residual, axis=-1)
        done = all_along(solved | ~finite_rows).astype(jnp.int32)
        done = everywhere(done, axis, lax.pmin) > 0
        unchanged = jnp.where(finite_rows[:, None], starts, jnp.nan)
        new = jnp.where(done, unchanged, new)
        return new, {"radius": radius, "unsolved": ~done}, ends
