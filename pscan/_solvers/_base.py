"""What every solver sees: the flattened `Problem`, and the `AbstractSolver` interface."""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from .._associative import fold
from .._axis import everywhere
from .._chunking import to_chunks
from .._finite import finite_along
from .._solution import RESULTS


class Problem(eqx.Module):
    """One recurrence, as a solver sees it: `h[t] = step(params, z[t], h[t-1])` on flat
    state vectors, `h[-1] = h0`, with `z[t] = project(params, x[t])` (`z = x` when
    `project` is None).

    `pscan.recurrence` builds it from a cell: pytree states are raveled to vectors of
    size `d`, and for a `pscan.nn.AbstractCell` the state-independent `project` is split
    off so that every run over a block of steps applies it to the whole block at once
    (one matrix product, not one per step). Solvers run blocks of steps with `scan`.

    **Attributes:**

    - `step`: `step(params, z, h) -> h_next`, on flat states `(d,)` (static).
    - `params`: the cell, a pytree whose inexact arrays are differentiable parameters.
    - `xs`: the inputs, a pytree of arrays with a leading time axis of length `T`.
    - `h0`: the flat initial state, shape `(d,)`.
    - `project`: `project(params, x) -> z`, or None (static).
    - `guess`: None, or flat states `(T, d)` to start an iteration from (a warm
        start; never differentiated).
    - `throw`: whether a solve that did not converge must raise at run time (static;
        `recurrence`'s `throw`). A solver checks something small that the states
        depend on (the iterating solvers: their chunk starts, with
        `RESULTS.error_if`), never the states themselves: a check on `(T, d)` states
        would hold a copy of them, in the forward pass and in the gradient's.
    - `resets`: whether some steps start from `h0` whatever the state (`recurrence`
        with `resets`; static): their Jacobians are exactly zero, and a dense linear
        solve over them must forget a non-finite state there, as a loop does (a guard
        that costs compile time, so only where there are resets).
    """

    step: Callable = eqx.field(static=True)
    params: PyTree
    xs: PyTree[Array]
    h0: Array
    project: Callable | None = eqx.field(static=True, default=None)
    guess: Array | None = None
    throw: bool = eqx.field(static=True, default=False)
    resets: bool = eqx.field(static=True, default=False)

    @property
    def length(self) -> int:
        """The number of steps `T`."""
        return jax.tree_util.tree_leaves(self.xs)[0].shape[0]

    def scan(
        self,
        h0: Array,
        xs: PyTree[Array],
        emit: bool = True,
        params: PyTree | None = None,
        unroll: int = 1,
        weights: Array | None = None,
    ) -> tuple[Array | None, Array]:
        """The exact recurrence over a block of steps, by `lax.scan`.

        **Arguments:**

        - `h0`: the state before the block, `(d,)`.
        - `xs`: the block's inputs, leading axis its length.
        - `emit`: whether to return every state of the block.
        - `params`: parameters to use instead of `self.params` (to differentiate).
        - `unroll`: passed to `lax.scan`.
        - `weights`: None, or an array like the block's states `(C, d)`: then the first
            output is `sum(weights * hs)` (the states are never stored: a derivative of
            it is `(dhs / dh0)^T weights` for one forward-mode product).

        **Returns:**

        `(hs, h_final)`: the states `(C, d)` (None unless `emit`; their weighted sum if
        `weights` is given) and the last one.
        """
        params = self.params if params is None else params
        if self.project is not None:
            xs = jax.vmap(lambda x: self.project(params, x))(xs)

        if jax.tree_util.tree_leaves(xs)[0].shape[0] == 1:
            # one step (DEER's chunks): no loop, so that derivatives of it (the
            # per-step Jacobians) are plain vectorised ones
            h = self.step(params, jax.tree_util.tree_map(lambda z: z[0], xs), h0)
            if weights is not None:
                return jnp.sum(weights[0] * h), h
            return (h[None] if emit else None), h

        if weights is not None:

            def weighted(carry, zw):
                h, total = carry
                h = self.step(params, zw[0], h)
                return (h, total + jnp.sum(zw[1] * h)), None

            zero = jnp.zeros_like(jnp.sum(weights[0] * h0))  # typed like both
            (h_final, total), _ = lax.scan(weighted, (h0, zero), (xs, weights))
            return total, h_final

        def body(h, z):
            h = self.step(params, z, h)
            return h, (h if emit else None)

        h_final, hs = lax.scan(body, h0, xs, unroll=unroll)
        return hs, h_final

    def project_chunks(self, xs: PyTree[Array]) -> PyTree[Array]:
        """The steps' inputs `z` of inputs in chunks: `project` applied to every step
        at once (`xs` itself when it is None).

        **Arguments:**

        - `xs`: the inputs in chunks, leading axes `(K, C)`.

        **Returns:**

        `z`, leading axes `(K, C)`.
        """
        if self.project is None:
            return xs
        return jax.vmap(jax.vmap(lambda x: self.project(self.params, x)))(xs)

    def step_chunks(self, h: Array, z: PyTree[Array]) -> Array:
        """One step of every chunk at once: `step` vectorised over the chunks, the
        parameters shared.

        **Arguments:**

        - `h`: each chunk's state before the step, `(K, d)`.
        - `z`: the step's inputs (projected), leading axis `K`.

        **Returns:**

        The states after the step, `(K, d)`.
        """
        return jax.vmap(lambda h, z: self.step(self.params, z, h))(h, z)

    def scan_chunks(self, starts: Array, xs: PyTree[Array]) -> Array:
        """Every chunk's states, each chunk from its start: `jax.vmap(self.scan)` in
        value, but run as one loop over the steps of all chunks at once that reads
        and writes the `(K, C, ...)` layout in place. (A vectorised `lax.scan` writes
        `(C, K, ...)`, one more T-long copy to read out; it stays what derivatives
        use: autodiff through this loop measured slower and heavier.)

        **Arguments:**

        - `starts`: the chunk starts, `(K, d)`.
        - `xs`: the inputs in chunks, leading axes `(K, C)`.

        **Returns:**

        The states `(K, C, d)`.
        """
        xs = self.project_chunks(xs)

        def step(h, z):
            h = self.step_chunks(h, z)
            return h, h

        return fold(step, starts, xs, axis=1, reverse=False)[0]


def chunk_xs(problem: Problem, chunk_size: int) -> PyTree[Array]:
    """`xs` as `(K, C, ...)`; the tail is padded with the last input (padded steps come
    after every real one, so they never affect a real state)."""
    last = jax.tree_util.tree_map(lambda x: x[-1], problem.xs)
    return to_chunks(problem.xs, chunk_size, fill=last)


class AbstractSolver(eqx.Module):
    """Base class of the solvers `pscan.recurrence` takes: `Sequential`, `Picard`,
    `Newton`, or your own. Hyperparameters are static fields, validated in
    `__check_init__`; a solver implements `solve`."""

    @abc.abstractmethod
    def solve(self, problem: Problem) -> tuple[Array, RESULTS, dict[str, Any]]:
        """Solves one recurrence.

        **Arguments:**

        - `problem`: a `pscan.Problem`: the step function, its parameters, the inputs
            and the flat initial state.

        **Returns:**

        `(hs, result, stats)`: the flat states `(T, d)`, a `pscan.RESULTS` code and the
        statistics that `pscan.Solution.stats` documents. Gradients of `hs` must be
        exact: either `solve` is differentiable as written, or it defines its own rule.
        With `problem.throw`, a result of `RESULTS.max_iters_reached` must raise at run
        time (`pscan.recurrence` leaves that check to the solver).
        """

    def matrix_precision(self) -> str | None:
        """The default precision of float32 matrix products while this solver solves
        (`jax.default_matmul_precision`'s values): `pscan.recurrence` traces the cell,
        the solve and its derivatives under it. Products given a precision of their
        own keep it.

        **Returns:**

        A precision name, or None (the default): the caller's.
        """
        return None

    def jacobian_matrix_precision(self) -> str | None:
        """The precision at which the cell's Jacobians are traced in the forward
        iteration, apart from its residuals (`matrix_precision`), if it differs; and
        the approximate (not `exact`) Jacobians that precondition the derivatives'
        boundary iterations. `pscan.recurrence` then closure-converts a function
        cell at both.

        **Returns:**

        A precision name, or None (the default): the Jacobians at
        `matrix_precision`.
        """
        return None


def finite_result(hs: Array, axis_name: str | None = None) -> tuple[Array, RESULTS]:
    """`(finite, result)` for states that are the answer as they stand: the one rule
    of every solver, `successful` when all states are finite, `nonfinite` if not; with
    `axis_name`, all states on every device of that axis (the same on each)."""
    finite = finite_along(lax.stop_gradient(hs)).astype(jnp.int32)
    finite = everywhere(finite, axis_name, lax.pmin) > 0
    return finite, RESULTS.where(finite, RESULTS.successful, RESULTS.nonfinite)


def as_python(value):
    """A NumPy scalar hyperparameter as the Python number it stands for (static fields
    must not hold arrays); anything else unchanged, for `__check_init__` to judge."""
    return value.item() if isinstance(value, (np.integer, np.floating)) else value


def check_solver(owner: str, solver, kind: type | None = None, allow_none=False):
    """Raises a `ValueError` naming `owner` unless `solver` is an instance of `kind`
    (`AbstractSolver` by default); a solver class passed uninstantiated is named as
    such, with the call that was meant."""
    kind = AbstractSolver if kind is None else kind
    if (solver is None and allow_none) or isinstance(solver, kind):
        return
    if kind is AbstractSolver:
        wanted = (
            "a pscan solver: pscan.Sequential(), pscan.Picard(...), pscan.Newton(...), "
            "pscan.ELK(...) or an instance of your own pscan.AbstractSolver subclass"
        )
    else:  # parallel in time
        wanted = (
            "a solver that is parallel in time: pscan.Picard(...), pscan.Newton(...), "
            "pscan.ELK(...) or an instance of your own pscan.AbstractShootingSolver "
            "subclass"
        )
    if allow_none:
        wanted = "None or " + wanted
    got = repr(solver)
    if isinstance(solver, type) and issubclass(solver, kind):
        name = solver.__name__
        if solver.__module__.split(".")[0] == "pscan":
            name = f"pscan.{name}"
        got = f"the class {name} itself (did you mean {name}()?)"
    raise ValueError(f"pscan.{owner}: `solver` must be {wanted}; got {got}")


def check_tolerance(owner: str, name: str, value):
    """Raises a `ValueError` naming `owner.name` unless `value` is a number >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not value >= 0
    ):
        raise ValueError(
            f"pscan.{owner}: `{name}` must be a non-negative number, got {value!r}"
        )
