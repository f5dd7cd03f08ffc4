"""The protocol of the parallel-in-time solvers (`Picard`, `Newton`, `ELK`, your own)."""

import abc
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._arguments import check_positive_int
from .._solution import RESULTS
from ._adjoint import implicit_states
from ._base import AbstractSolver, Problem, check_tolerance
from ._chunks import Chunks
from ._iterate import shooting_forward
from ._jacobian import AbstractJacobian


class AbstractShootingSolver(AbstractSolver):
    """Base class of the solvers that iterate on the chunk-start states, with exact
    sequential runs inside chunks (`pscan.Picard`, `pscan.Newton`, `pscan.ELK`).

    A solver is its `step`: new chunk starts from the current ones (and a solver
    state of its own, from `init`, that the loop carries from one iteration to the
    next). The loop around it is shared: it stops when no start moved by more than
    `atol + rtol * |s|` or after `max_iters` steps, replaces non-finite rows of a step
    by a Picard sweep (from the chunk ends that `step` returns), holds iterates that
    run away at +-sqrt(largest float), and gives the sequential loop's answer on
    non-finite data. The gradient is implicit, never through the iterations:
    `linearisation` names the Jacobian structure it may use (`pscan.DenseJacobian`:
    solved at once; `pscan.DiagonalJacobian`: a preconditioner; None: products with
    the exact Jacobian only).

    Subclasses declare the fields below (static, as in `pscan.Picard`) and `step`.

    **Fields:**

    - `chunk_size`: steps per chunk.
    - `max_iters`: the most steps.
    - `rtol`, `atol`: the convergence tolerances on the chunk starts.
    - `fallback`: None, or `"sequential"`: the exact sequential states when not
        converged (`stats["fell_back"]`), and a sequential sweep over the chunks for
        the derivatives' boundary iterations after `max_iters` (without it they go on
        in parallel until they converge, exact after K iterations).
    - `axis_name`: None, or inside `shard_map` the mesh axis that splits time.
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

    def init(self, chunks: Chunks, starts: Array) -> PyTree:
        """The solver state before the first `step` (default: None).

        **Arguments:**

        - `chunks`: the `pscan.Chunks` of the problem.
        - `starts`: the first guess of the chunk starts, `(K, d)`.

        **Returns:**

        A pytree of arrays, the same structure, shapes and dtypes as `step` returns.
        """
        return None

    @abc.abstractmethod
    def step(
        self, chunks: Chunks, starts: Array, state: PyTree
    ) -> tuple[Array, PyTree, Array | None]:
        """One iteration.

        **Arguments:**

        - `chunks`: the `pscan.Chunks` of the problem (`chunks.ends`, `chunks.shift`,
            `chunks.linearise`, ...).
        - `starts`: the current chunk starts `(K, d)`; `starts[0]` is `h0` (on the
            first device).
        - `state`: the solver state from `init` or the last `step`.

        **Returns:**

        `(new_starts, new_state, ends)`: the new starts with `new_starts[0] = h0`,
        and the chunk ends `F_k(starts[k])`, `(K, d)`, if the step ran the chunks from
        `starts` (`chunks.ends`, `chunks.ends_and_linearise`), else None. The loop
        replaces non-finite rows of `new_starts` by a Picard sweep, `chunks.shift(ends)`:
        given the ends, it needs no run of the chunks of its own (one copy of the cell
        fewer in the compiled program).
        """

    def unfinished(self, state: PyTree) -> Array:
        """Whether the loop must go on whatever the last step changed: True after a
        step that changed nothing on purpose (a rejected trial step of a trust-region
        method), which is no sign of convergence.

        **Returns:**

        A scalar bool array (default: False).
        """
        return jnp.array(False)

    def statistics(self, state: PyTree) -> dict[str, Array]:
        """What the final solver state adds to `pscan.Solution.stats` (default:
        nothing; `pscan.ELK` reports its trust radius).

        **Returns:**

        A dict of arrays, its keys other than those every solver reports.
        """
        return {}

    def linearisation(self) -> type[AbstractJacobian] | None:
        """The Jacobian structure that the implicit gradient builds and uses.

        **Returns:**

        An `AbstractJacobian` subclass (`pscan.DenseJacobian`: the boundary
        recurrences are solved at once; `pscan.DiagonalJacobian`: it preconditions an
        iteration of exact products), or None (the default: products with the exact
        Jacobian only, as Picard).
        """
        return None

    def solve(self, problem: Problem) -> tuple[Array, RESULTS, dict[str, Any]]:
        if self.axis_name is not None and problem.length % self.chunk_size:
            raise ValueError(
                f"pscan.{self.name}: with `axis_name`, each device's block of steps must "
                f"be a multiple of `chunk_size` ({self.chunk_size}), got "
                f"{problem.length} steps (pscan.sharded_recurrence pads for you)"
            )
        # the iteration is never differentiated; the states' derivative is implicit
        starts, result, stats = shooting_forward(self, problem)
        if problem.throw and self.fallback is None:
            # on a scalar tied to the `(K, d)` starts that every state depends on: a
            # check on the states themselves would hold a copy of them in the
            # gradient, and one on the starts inside `shard_map` would mix, in
            # Equinox's conditional, values typed as varying across the devices with
            # its callback's, which are not (an error with variance checks on)
            failed = result == RESULTS.max_iters_reached
            zero = result.error_if(jnp.zeros((), starts.real.dtype), failed)
            starts = starts + zero.astype(starts.dtype)
        return implicit_states(self, problem, starts, result, stats)
