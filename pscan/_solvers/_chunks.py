"""`Chunks`: a recurrence as a shooting solver sees it, K chunks of exact runs."""

from contextlib import nullcontext

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

from .._axis import shift_backward, shift_forward
from .._chunking import from_chunks
from .._precision import linearising
from ._base import Problem, chunk_xs
from ._jacobian import AbstractJacobian


class Chunks(eqx.Module):
    """The recurrence split into K chunks of `chunk_size` steps: the unknowns of a
    shooting solver are the chunk-start states `s[k]` (`s[0] = h0`), a fixed point of
    `s[k+1] = F_k(s[k])`, where `F_k` runs the cell exactly and sequentially over
    chunk k. With `axis_name` (inside `shard_map`) these are one device's chunks, and
    `shift` crosses devices.

    **Attributes:**

    - `problem`: the `pscan.Problem`.
    - `xs`: the inputs in chunks, leading axes `(K, chunk_size)`.
    - `axis_name`: None, or the mesh axis that splits time.
    """

    problem: Problem
    xs: PyTree[Array]
    axis_name: str | None = eqx.field(static=True)

    def __init__(self, problem: Problem, chunk_size: int, axis_name: str | None):
        self.problem = problem
        self.xs = chunk_xs(problem, chunk_size)
        self.axis_name = axis_name

    @property
    def h0(self) -> Array:
        """The initial state `(d,)`: the first chunk's start."""
        return self.problem.h0

    @property
    def count(self) -> int:
        """K, the number of chunks (on this device)."""
        return jax.tree_util.tree_leaves(self.xs)[0].shape[0]

    def end(self, s: Array, xs_k: PyTree[Array]) -> Array:
        """`F_k(s)`: runs one chunk (inputs `xs_k`, a slice of `xs`) from `s`.

        **Returns:**

        The state after the chunk's last step, `(d,)`.
        """
        return self.problem.scan(s, xs_k, emit=False)[1]

    def ends(self, starts: Array) -> Array:
        """Every chunk from its start, in parallel.

        **Returns:**

        `F_k(starts[k])` for every k, `(K, d)`.
        """
        return jax.vmap(self.end)(starts, self.xs)

    def first_steps(self, starts: Array) -> Array:
        """Every chunk's first step from its start, in parallel.

        **Returns:**

        The state after each chunk's first step, `(K, d)` (the chunk ends when
        `chunk_size=1`).
        """
        first = jax.tree_util.tree_map(lambda x: x[:, :1], self.xs)
        return jax.vmap(self.end)(starts, first)

    def shift(self, ends: Array) -> Array:
        """The chunk starts that chunk ends imply (across devices with `axis_name`).

        **Returns:**

        `[h0, ends[0], ..., ends[K-2]]`, `(K, d)`.
        """
        return shift_forward(ends, self.h0, self.axis_name)

    def following(self, starts: Array) -> Array:
        """The next chunk's start, for every chunk (across devices with `axis_name`).

        **Returns:**

        `starts[k + 1]` for every k (zero after the last chunk), `(K, d)`.
        """
        return shift_backward(starts, self.axis_name)

    def linearise(
        self,
        structure: type[AbstractJacobian],
        starts: Array,
        precision: str | None = None,
    ) -> AbstractJacobian:
        """Linearises the leading chunks, as many as `starts` has rows (all K, or
        fewer: a solver that never uses the last chunk's Jacobian passes
        `starts[:-1]`), each at its start; with a `precision`, the cell's products
        at it (`pscan._precision.linearising`).

        **Returns:**

        The chunk Jacobians `dF_k/ds` at `starts`, as a `structure` operator
        (`pscan.DenseJacobian`, `pscan.DiagonalJacobian`).
        """
        xs = jax.tree_util.tree_map(lambda x: x[: starts.shape[0]], self.xs)
        context = nullcontext() if precision is None else linearising(precision)
        with context:
            return structure.linearise(self.end, starts, xs)

    def ends_and_linearise(
        self,
        structure: type[AbstractJacobian],
        starts: Array,
        precision: str | None = None,
    ) -> tuple[Array, AbstractJacobian]:
        """`ends(starts)` and `linearise(structure, starts)` for every chunk, from one
        forward-mode pass (its values are the ends): no separate run of the chunks,
        in the compiled program or at run time; or, with a `precision`, the ends as
        they stand and the Jacobians apart, their products at `precision`.

        **Returns:**

        `(ends, operator)`: `F_k(starts[k])`, `(K, d)`, and the K chunk Jacobians.
        """
        if precision is not None:
            return self.ends(starts), self.linearise(structure, starts, precision)
        jac, ends = structure.linearise(self.end, starts, self.xs, value=True)
        return ends, jac

    def states(self, starts: Array) -> Array:
        """Every chunk run from its start, in parallel, every state kept.

        **Returns:**

        The states `(T, d)` (the padding of the last chunk left out).
        """
        return from_chunks(
            self.problem.scan_chunks(starts, self.xs), self.problem.length
        )
