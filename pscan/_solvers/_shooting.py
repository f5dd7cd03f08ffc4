"""The base class of the parallel-in-time solvers (`Picard`, `Newton`)."""

import abc
from typing import ClassVar

import equinox as eqx
from jaxtyping import Array

from ._adjoint import shooting_solve
from ._base import AbstractSolver, check_positive_int, check_tolerance


class AbstractShootingSolver(AbstractSolver):
    """Iterates on the chunk-start states, with exact sequential runs inside chunks.

    Subclasses give `_update`: the new chunk starts from the current ones. The
    gradient is implicit (`_adjoint.py`): it never differentiates through iterations.
    """

    chunk_size: eqx.AbstractVar[int]
    max_iters: eqx.AbstractVar[int]
    rtol: eqx.AbstractVar[float]
    atol: eqx.AbstractVar[float]
    fallback: eqx.AbstractVar[str | None]
    axis_name: eqx.AbstractVar[str | None]
    name: ClassVar[str] = "solver"

    def __check_init__(self):
        check_positive_int(self.name, "chunk_size", self.chunk_size)
        check_positive_int(self.name, "max_iters", self.max_iters)
        check_tolerance(self.name, "rtol", self.rtol)
        check_tolerance(self.name, "atol", self.atol)
        if self.fallback not in (None, "sequential"):
            raise ValueError(
                f"pscan.{self.name}: `fallback` must be None or 'sequential', got "
                f"{self.fallback!r}"
            )
        if self.axis_name is not None and self.fallback is not None:
            raise ValueError(
                f"pscan.{self.name}: `fallback='sequential'` cannot be combined with "
                "`axis_name` (the exact fallback has no parallelism across devices)"
            )

    @abc.abstractmethod
    def _update(self, chunk_end, starts: Array, xs, h0: Array) -> Array:
        """New chunk starts `(K, d)` (the first is `h0`) from the current ones;
        `chunk_end(s, xs_k)` runs one chunk from `s`."""

    @property
    def _jacobian(self) -> str | None:
        """What `_linearise` gives: `"dense"`, `"diagonal"`, or None."""
        return None

    def _linearise(
        self, chunk_end, starts: Array, xs, transposed: bool = False
    ) -> Array | None:
        """The chunk Jacobians `J_k` at `starts` that the forward pass uses, and the
        implicit gradient too: dense `(K, d, d)` (`J_k^T` if `transposed`; a pytree
        of them if `chunk_end` returns one), diagonal `(K, d)`, or None (no
        Jacobians: the gradient iterates with vector-Jacobian products only)."""
        return None

    def solve(self, problem):
        if self.axis_name is not None and problem.length % self.chunk_size:
            raise ValueError(
                f"pscan.{self.name}: with `axis_name`, each device's block of steps must "
                f"be a multiple of `chunk_size` ({self.chunk_size}), got "
                f"{problem.length} steps (pscan.sharded_recurrence pads for you)"
            )
        return shooting_solve(self, problem)
