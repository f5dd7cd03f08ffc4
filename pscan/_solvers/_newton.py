from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from .._finite import finite_along
from .._linear import linear_recurrence
from .._precision import check_precision, separate_jacobian_precision
from ._base import as_python
from ._jacobian import STRUCTURES
from ._shooting import AbstractShootingSolver


class Newton(AbstractShootingSolver):
    """Newton's method on the chunk-start states (multiple shooting); DEER when
    `chunk_size=1`.

    The unknowns are the states `s[k]` at the start of each chunk; `F_k(s)` runs chunk
    `k` exactly from `s`. A Newton step linearises every `F_k` at once,
    `s[k+1] <- F_k(s[k]) + A_k (s_new[k] - s[k])` with `A_k = (1 - damping) J_k`, and
    solves that linear recurrence over the K chunks with `pscan.linear_recurrence`.
    Iteration `n` makes the first `n` chunks exact, so `ceil(T / chunk_size)`
    iterations always reach the sequential answer.

    - `chunk_size=1, jacobian="dense"` is DEER (Lim et al. 2024): memory `O(T d^2)`.
    - `jacobian="diagonal"` is quasi-Newton (quasi-DEER, Gonzalez et al. 2024): only
        the diagonal of `J_k`, by forward mode, memory `O(K d)` (the implicit gradient
        uses it too, to precondition its own iteration); more iterations. Its
        forward-mode products run `chunk_size / 8` (at most 16) at a time: about
        `T / 8` tangent states in flight.
    - `chunk_size > 1`: Jacobians of whole chunks, memory `O(K d^2)` with
        `K = T / chunk_size`; few iterations for contractive cells.

    Whatever the Jacobian used forward, the gradient is exact and implicit (see
    `pscan.recurrence`). A non-finite Newton step is replaced by a Picard sweep from
    the last finite guess; finite iterates that run away are held at +-sqrt(largest
    float) (a start held there never counts as converged).

    **Arguments:**

    - `chunk_size`: steps per chunk (`1`: every step is an unknown, as in DEER).
    - `jacobian`: `"dense"` or `"diagonal"`.
    - `damping`: `k` in `[0, 1)`; the step uses `(1 - k) J`, which stabilises
        iterations on stiff or chaotic cells at the price of more of them.
    - `max_iters`: the most iterations.
    - `rtol`, `atol`: converged when every chunk start changed by at most
        `atol + rtol * |s|` in the last iteration.
    - `fallback`: `None`, or `"sequential"` to return the exact sequential solution
        (and flag `stats["fell_back"]`) when not converged.
    - `axis_name`: inside `shard_map`, the mesh axis that splits time (each device
        holds a block of consecutive steps, a multiple of `chunk_size`); boundary
        states cross devices once per iteration. See `pscan.sharded_recurrence`.
    - `precision`: the precision of the cell's float32 matrix products while it
        solves (a value of `jax.default_matmul_precision`), `"highest"` by default:
        the chunk ends decide the fixed point, and on a TPU (or a GPU with TF32)
        the default products are rounded to about three digits (the whole solve at
        the default: DEER took 493 iterations instead of 74 on a mildly chaotic cell
        at T = 500 on a TPU v5e, its states 4.6e-3 from the loop's; on a
        contractive GRU full precision cost 1.7x the time, 1.05x with the Jacobians
        at `jacobian_precision`: see the benchmarks page). None: the caller's
        precision. No effect on CPU.
    - `jacobian_precision`: the precision of the cell's products in the forward-mode
        pass that builds the Jacobians, `"default"` by default. The step needs only
        an approximate Jacobian: the chunk ends (the residuals, which decide the
        fixed point) run apart at `precision`, the Jacobians at the faster default
        (on a TPU v5e: the same iterations as at `"highest"` on a mildly chaotic
        cell, `Newton(chunk_size=128)` 1.5x faster on a GRU). None, the same as
        `precision`, or `precision=None`: one pass at `precision` for both. The
        derivatives' dense Jacobians are always at `precision` (exact transposes
        are what make it the gradient: at `"high"` a chaotic cell's was 25-600x
        further from the loop's); their diagonal preconditioner is at
        `jacobian_precision`. No effect on CPU (one pass); not measured on a GPU.
    """

    chunk_size: int = eqx.field(static=True, default=1, converter=as_python)
    jacobian: str = eqx.field(static=True, default="dense")
    damping: float = eqx.field(static=True, default=0.0, converter=as_python)
    max_iters: int = eqx.field(static=True, default=100, converter=as_python)
    rtol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    atol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    fallback: str | None = eqx.field(static=True, default=None)
    axis_name: str | None = eqx.field(static=True, default=None)
    precision: str | None = eqx.field(static=True, default="highest")
    jacobian_precision: str | None = eqx.field(static=True, default="default")
    name: ClassVar[str] = "Newton"

    def __check_init__(self):
        if self.jacobian not in ("dense", "diagonal"):
            raise ValueError(
                f"pscan.Newton: `jacobian` must be 'dense' or 'diagonal', got {self.jacobian!r}"
            )
        d = self.damping
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
            raise ValueError(f"pscan.Newton: `damping` must be in [0, 1), got {d!r}")
        check_precision("Newton", self.precision)
        check_precision("Newton", self.jacobian_precision, "jacobian_precision")

    def matrix_precision(self):
        return self.precision

    def jacobian_matrix_precision(self):
        return separate_jacobian_precision(self.precision, self.jacobian_precision)

    def linearisation(self):
        return STRUCTURES[self.jacobian]

    def step(self, chunks, starts, state):
        ends, jac = chunks.ends_and_linearise(
            self.linearisation(), starts, self.jacobian_matrix_precision()
        )
        new = newton_starts(chunks, starts, ends, jac.scale(1 - self.damping))
        return new, state, ends


def newton_starts(chunks, starts, ends, jac):
    """The Newton step on the chunk starts: the solution of the linear recurrence
    `s_new[k+1] = ends[k] + J_k (s_new[k] - starts[k])`, `s_new[0] = h0`, with `jac`
    the Jacobians of every chunk. The recurrence runs over all K chunks, the last
    one's result (the start of a chunk after the last) dropped by the shift, or
    across devices the start of the next device's first chunk: no slice of the
    Jacobians (a copy of them per iteration, and kernels of its own).

    A chunk with a non-finite end or Jacobian (after a non-finite input) must not
    spread NaN through the linear solve to every later chunk: its start is taken as
    it is (a zero Jacobian, the next start as its end), and its end is marked
    non-finite again afterwards for the loop to hold."""
    following = chunks.following(starts)
    end_ok = finite_along(ends, axis=-1)
    ok = end_ok & jac.finite()
    jac = jac.rows(ok)  # zero where not `ok`: `ends - J s` is then `ends`
    b = jnp.where(end_ok[:, None], ends - jac.mv(starts), following)
    after = linear_recurrence(
        jac.coefficients(), b, chunks.h0, axis_name=chunks.axis_name
    )
    after = jnp.where(end_ok[:, None], after, jnp.nan)
    return chunks.shift(after)
