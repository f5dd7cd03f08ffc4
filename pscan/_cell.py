"""The cell protocol: what a cell may tell pscan beyond `cell(x, h) -> h_next`."""

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ._linear import _apply


class AbstractCell(eqx.Module):
    """Base class of pscan's recurrent cells, `h_next = cell(x, h)`.

    A cell is split in two: `project(x)`, the part that does not depend on the state,
    and `step(z, h)`, the recurrence proper, so that `cell(x, h) = step(project(x), h)`.
    pscan applies `project` to a whole block of steps at once (one matrix product, not
    one per step) and loops only over `step`. Any callable `cell(x, h) -> h_next` works
    with `pscan.recurrence` and `pscan.nn.Recurrence`; subclassing this class adds that
    split, a default initial state and a readout.

    Subclasses implement `step` and `init_state`, and may override `project` (default:
    the identity) and `readout` (default: the state).
    """

    def project(self, x: PyTree[Array]) -> PyTree[Array]:
        """The state-independent part of one step, `z = project(x)`.

        **Arguments:**

        - `x`: the input of one step.

        **Returns:**

        What `step` takes as its input (by default `x` itself).
        """
        return x

    @abc.abstractmethod
    def step(self, z: PyTree[Array], h: PyTree[Array]) -> PyTree[Array]:
        """The recurrence on projected inputs.

        **Arguments:**

        - `z`: `project(x)` for the input `x` of this step.
        - `h`: the previous state.

        **Returns:**

        The next state, shaped like `h`.
        """

    @abc.abstractmethod
    def init_state(self) -> PyTree[Array]:
        """The state before the first step when none is given (usually zeros).

        **Returns:**

        A pytree of arrays: the shape and dtype of every state.
        """

    def readout(self, x: PyTree[Array], h: PyTree[Array]) -> PyTree[Array]:
        """The output of one step from its input and its new state.

        **Arguments:**

        - `x`: the input of the step.
        - `h`: the state after the step.

        **Returns:**

        The output (by default the state `h`).
        """
        return h

    def __call__(self, x: PyTree[Array], h: PyTree[Array]) -> PyTree[Array]:
        """One step, `step(project(x), h)`.

        **Arguments:**

        - `x`: the input of the step.
        - `h`: the previous state.

        **Returns:**

        The next state.
        """
        return self.step(self.project(x), h)


class AbstractLinearCell(AbstractCell):
    """A cell that is linear in its state: `h_next = a(x) * h + b(x)`.

    Subclasses give the per-step coefficients of a whole sequence at once in
    `coefficients`; `pscan.nn.Recurrence` then runs `pscan.linear_recurrence` on them,
    exactly and with no iteration. The single-step `__call__` (and so `pscan.recurrence`
    and a hand-written `lax.scan`) works too.
    """

    @abc.abstractmethod
    def coefficients(self, xs: Array) -> tuple[Array, Array]:
        """The coefficients of every step of a sequence.

        **Arguments:**

        - `xs`: the inputs, with a leading time axis of length `T`.

        **Returns:**

        `(a, b)` as `pscan.linear_recurrence` takes them: `b` of shape `(T, *S)` for
        states of shape `S`, and `a` broadcastable to it (per step `(T, *S)`, or shared
        by every step, e.g. of shape `S`), or a matrix per step `(T, *S[:-1], d, d)`.
        """

    def step(self, z: Array, h: Array) -> Array:
        a, b = self.coefficients(z[None])
        dense = jnp.ndim(a) == jnp.ndim(b) + 1
        return (_apply(a, h[None], dense) + b)[0]

    def __call__(self, x: Array, h: Array) -> Array:
        return self.step(x, h)


def cell_parts(cell):
    """`(step, project)` of a cell: its split when it is an `AbstractCell`, else
    `(cell, None)`."""
    if isinstance(cell, AbstractCell) and not isinstance(cell, AbstractLinearCell):
        return (lambda c, z, h: c.step(z, h)), (lambda c, x: c.project(x))
    return (lambda c, x, h: c(x, h)), None
