from typing import ClassVar

import equinox as eqx

from .._precision import check_precision
from ._base import as_python
from ._shooting import AbstractShootingSolver


class Picard(AbstractShootingSolver):
    """Fixed-point (Picard) iteration on the chunk-start states.

    Each sweep runs every chunk in parallel, exactly and sequentially inside the chunk,
    from the previous sweep's chunk ends. Sweep `n` makes the first `n` chunks exact, so
    `ceil(T / chunk_size)` sweeps always reach the sequential answer; contractive cells
    (most trained RNNs) converge in a few. No Jacobians in the forward pass; the
    gradient is implicit (see `pscan.recurrence`).

    **Arguments:**

    - `chunk_size`: steps per chunk.
    - `max_iters`: the most sweeps.
    - `rtol`, `atol`: converged when every chunk start changed by at most
        `atol + rtol * |s|` in the last sweep.
    - `fallback`: `None`, or `"sequential"` to return the exact sequential solution
        (and flag `stats["fell_back"]`) when not converged.
    - `axis_name`: inside `shard_map`, the mesh axis that splits time (each device
        holds a block of consecutive steps, a multiple of `chunk_size`); boundary
        states cross devices once per iteration. See `pscan.sharded_recurrence`.
    - `precision`: the precision of the cell's float32 matrix products while it
        solves (a value of `jax.default_matmul_precision`), `"highest"` by default:
        the chunk runs batch the cell's products over the chunks, which the default
        precision of a TPU (or a GPU with TF32) rounds to about three digits, where
        a sequential loop's matrix-vector products are exact (GRU 1 -> 32, T = 65536,
        TPU v5e, tolerance 1e-5: states 4.6e-4 from `lax.scan`'s at the default,
        9.8e-7 at `"highest"`, for 1.14x the time; see the benchmarks page). None:
        the caller's precision. No effect on CPU.
    """

    chunk_size: int = eqx.field(static=True, default=64, converter=as_python)
    max_iters: int = eqx.field(static=True, default=100, converter=as_python)
    rtol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    atol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    fallback: str | None = eqx.field(static=True, default=None)
    axis_name: str | None = eqx.field(static=True, default=None)
    precision: str | None = eqx.field(static=True, default="highest")
    name: ClassVar[str] = "Picard"

    def __check_init__(self):
        check_precision("Picard", self.precision)

    def matrix_precision(self):
        return self.precision

    def step(self, chunks, starts, state):
        ends = chunks.ends(starts)
        return chunks.shift(ends), state, ends
