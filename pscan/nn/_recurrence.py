import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._cell import AbstractCell, AbstractLinearCell
from .._linear import linear_recurrence
from .._recurrence import recurrence
from .._solvers import AbstractSolver, Newton, Sequential


def default_solver(length: int, dtype) -> AbstractSolver:
    """The solver `Recurrence(cell, solver=None)` uses for a sequence of `length` steps
    on the default backend.

    - CPU: `Sequential(checkpoint=C)`, exact, with `C` the power of two nearest
        `sqrt(length)`, so a gradient stores `O(sqrt(length))` states besides the
        outputs.
    - GPU / TPU: `Newton(chunk_size=128)`, chunked multiple shooting, with tolerances
        `100 eps` of the state dtype (at least `1e-6`); it raises if it does not
        converge in 64 iterations.

    **Arguments:**

    - `length`: the number of steps `T`.
    - `dtype`: the (real) dtype of the state.

    **Returns:**

    A pscan solver.
    """
    if jax.default_backend() == "cpu":
        every = 2 ** round(math.log2(math.sqrt(length)))
        return Sequential(checkpoint=max(1, every))
    tol = max(1e-6, 100 * float(jnp.finfo(dtype).eps))
    return Newton(chunk_size=128, rtol=tol, atol=tol, max_iters=64)


def _zeros_state(cell, dtype) -> PyTree[Array] | None:
    """The default initial state, when the cell tells its state's shape."""
    if isinstance(cell, AbstractCell):
        return cell.init_state()
    if isinstance(cell, eqx.nn.LSTMCell):
        dtype = cell.weight_hh.dtype
        return (jnp.zeros(cell.hidden_size, dtype), jnp.zeros(cell.hidden_size, dtype))
    size = getattr(cell, "hidden_size", None)
    if isinstance(size, int):
        weight = getattr(cell, "weight_hh", None)
        return jnp.zeros(size, dtype if weight is None else weight.dtype)
    return None


def _shapes(tree):
    return jax.tree_util.tree_map(
        lambda x: (jnp.shape(x), str(jnp.result_type(x))), tree
    )


class Recurrence(eqx.Module):
    """A recurrent layer: runs a cell over one whole sequence and returns every output.

    `layer(xs)` is `h[t] = cell(xs[t], h[t-1])` for every `t` (or, with `reverse=True`,
    `h[t] = cell(xs[t], h[t+1])` from the end), by `pscan.recurrence` with `solver`,
    followed by the cell's `readout` when it has one. Cells linear in their state
    (`pscan.nn.AbstractLinearCell`: `MinGRU`, `MinLSTM`, `LRU`) run through
    `pscan.linear_recurrence` on their coefficients: exact, no iteration.

    Like Equinox's layers it takes one unbatched sequence; `jax.vmap` it for a batch.

    **Arguments:**

    - `cell`: `cell(x, h) -> h_next`: a `pscan.nn` cell, `eqx.nn.GRUCell`,
        `eqx.nn.LSTMCell` (state `(h, c)`), or any callable pytree.
    - `solver`: a pscan solver, or `None` for the backend's default: on CPU the exact
        `pscan.Sequential(checkpoint=C)` with `C ~ sqrt(T)`; on GPU/TPU chunked
        `pscan.Newton(chunk_size=128)` (see `default_solver`). With a linear cell,
        `None` means `pscan.linear_recurrence`; a solver given explicitly is used
        instead.
    - `reverse`: run from the last step to the first.
    """

    cell: PyTree
    solver: AbstractSolver | None = None
    reverse: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        if self.solver is not None and not isinstance(self.solver, AbstractSolver):
            raise ValueError(
                f"pscan.nn.Recurrence: `solver` must be None or a pscan solver (Sequential, "
                f"Picard, Newton), got {self.solver!r}"
            )
        if not callable(self.cell):
            raise ValueError(
                f"pscan.nn.Recurrence: `cell` must be callable, got {self.cell!r}"
            )

    def __call__(self, xs: Array, h0: PyTree[Array] | None = None) -> PyTree[Array]:
        """Runs the cell over the sequence.

        **Arguments:**

        - `xs`: one sequence, shape `(T, in_features)` with `T >= 1`.
        - `h0`: the state before the first step; by default the cell's
            `init_state()` (zeros; `(zeros, zeros)` for `eqx.nn.LSTMCell`).

        **Returns:**

        The output after every step, with a leading axis of length `T`: the states
        (a pytree like `h0`), or the cell's `readout` of them (the real outputs of
        `LRU`).

        **Raises:**

        `ValueError` at trace time when `xs` is not `(T, in_features)` or `h0` is not
        shaped like the cell's state.
        """
        name = f"pscan.nn.Recurrence({type(self.cell).__name__})"
        features = getattr(
            self.cell, "in_features", getattr(self.cell, "input_size", None)
        )
        shape = jnp.shape(xs)
        if (
            len(shape) != 2
            or shape[0] == 0
            or (isinstance(features, int) and shape[1] != features)
        ):
            want = features if isinstance(features, int) else "in_features"
            hint = " (one unbatched sequence: jax.vmap the layer for a batch)"
            raise ValueError(
                f"{name}: `xs` must have shape (T, {want}) with T >= 1{hint}, got "
                f"{shape}"
            )
        xs = jnp.asarray(xs)
        default = _zeros_state(self.cell, xs.dtype)
        if h0 is None:
            if default is None:
                raise ValueError(
                    f"{name}: the cell does not tell its state's shape (no `hidden_size` "
                    "or `init_state`): pass `h0`"
                )
            h0 = default
        elif default is not None and _shapes(h0) != _shapes(default):
            raise ValueError(
                f"{name}: `h0` must be shaped like the cell's state {_shapes(default)}, "
                f"got {_shapes(h0)}"
            )
        state_dtype = jax.tree_util.tree_leaves(h0)[0].real.dtype
        if jnp.issubdtype(xs.dtype, jnp.floating) and (
            jnp.finfo(xs.dtype).bits > jnp.finfo(state_dtype).bits
        ):
            raise ValueError(
                f"{name}: `xs` has dtype {xs.dtype} but the cell's state is "
                f"{state_dtype}: cast `xs` to {state_dtype}, or build the cell with "
                f"`dtype={xs.dtype}`"
            )
        if isinstance(self.cell, AbstractLinearCell) and self.solver is None:
            a, b = self.cell.coefficients(xs)
            hs = linear_recurrence(a, b, h0, reverse=self.reverse)
        else:
            solver = self.solver
            if solver is None:
                dtype = jax.tree_util.tree_leaves(h0)[0].real.dtype
                solver = default_solver(shape[0], dtype)
            flip = lambda tree: jax.tree_util.tree_map(lambda x: jnp.flip(x, 0), tree)
            inputs = flip(xs) if self.reverse else xs
            hs = recurrence(self.cell, inputs, h0, solver=solver).hs
            hs = flip(hs) if self.reverse else hs
        if isinstance(self.cell, AbstractCell):
            hs = jax.vmap(self.cell.readout)(xs, hs)
        return hs
