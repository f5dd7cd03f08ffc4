import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree

from .._arguments import check_flag
from .._cell import AbstractCell, AbstractLinearCell
from .._linear import linear_recurrence
from .._recurrence import recurrence
from .._segments import along_time, check_segments
from .._solvers import AbstractSolver, Newton, Sequential, check_solver


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


def _output(cell, x, h):
    """The output of one step of a layer: the cell's `readout` (a `pscan.nn` cell),
    `h` of a state `(h, c)` (the Equinox LSTM convention, for any tuple state), or
    the state itself."""
    if isinstance(cell, AbstractCell):
        return cell.readout(x, h)
    if isinstance(h, (tuple, list)):
        return h[0]
    return h


class Recurrence(eqx.Module):
    """A recurrent layer: runs a cell over one whole sequence and returns every output.

    `layer(xs)` is `h[t] = cell(xs[t], h[t-1])` for every `t` (or, with `reverse=True`,
    `h[t] = cell(xs[t], h[t+1])` from the end), by `pscan.recurrence` with `solver`,
    and returns one output per step: the cell's `readout` for a `pscan.nn` cell (the
    real outputs of `LRU`), `h` for `eqx.nn.LSTMCell` (state `(h, c)`), else the
    state. Cells linear in their state (`pscan.nn.AbstractLinearCell`: `MinGRU`,
    `MinLSTM`, `LRU`) run through `pscan.linear_recurrence` on their coefficients:
    exact, no iteration.

    Like Equinox's layers it takes one unbatched sequence; `jax.vmap` it for a batch
    (a right-padded batch with one `length` per sequence, or one packed sequence with
    `resets`). Non-finite inputs give the sequential loop's outputs (exact before the
    first non-finite step, non-finite from it on, until a reset), never an error.

    **Arguments:**

    - `cell`: `cell(x, h) -> h_next`: a `pscan.nn` cell, `eqx.nn.GRUCell`,
        `eqx.nn.LSTMCell`, or any callable pytree.
    - `solver`: a pscan solver, or `None` for the backend's default: on CPU the exact
        `pscan.Sequential(checkpoint=C)` with `C ~ sqrt(T)`; on GPU/TPU chunked
        `pscan.Newton(chunk_size=128)` (see `default_solver`). With a linear cell,
        `None` means `pscan.linear_recurrence`; a solver given explicitly is used
        instead.
    - `reverse`: run from the last step to the first.
    - `return_state`: return `(outputs, final_state)` instead of the outputs: the
        state after the last step processed (after step `length - 1`, or after step 0
        with `reverse=True`), as the cell keeps it (complex for `LRU`, `(h, c)` for an
        LSTM), ready to be the `h0` of the next window.
    - `throw`: raise at run time if an iterative solver did not converge (see
        `pscan.recurrence`); with `throw=False` the outputs are those of the last
        iteration.
    """

    cell: PyTree
    solver: AbstractSolver | None = None
    reverse: bool = eqx.field(static=True, default=False, kw_only=True)
    return_state: bool = eqx.field(static=True, default=False, kw_only=True)
    throw: bool = eqx.field(static=True, default=True, kw_only=True)

    def __check_init__(self):
        check_solver("nn.Recurrence", self.solver, allow_none=True)
        for name in ("reverse", "return_state", "throw"):
            check_flag("nn.Recurrence", name, getattr(self, name))
        if not callable(self.cell):
            raise ValueError(
                f"pscan.nn.Recurrence: `cell` must be callable, got {self.cell!r}"
            )

    @property
    def _name(self) -> str:
        return f"pscan.nn.Recurrence({type(self.cell).__name__})"

    def init_state(self, dtype=None) -> PyTree[Array]:
        """The cell's default initial state (zeros): what `__call__` starts from when
        `h0` is None, and the start of a stream for `step`.

        **Arguments:**

        - `dtype`: the floating dtype for cells that do not tell theirs (default:
            float32, or float64 under `jax_enable_x64`).

        **Returns:**

        A pytree of arrays shaped like the cell's state.

        **Raises:**

        `ValueError` when the cell does not tell its state's shape (no `hidden_size`
        or `init_state`).
        """
        state = _zeros_state(
            self.cell, jnp.result_type(float) if dtype is None else dtype
        )
        if state is None:
            raise ValueError(
                f"{self._name}: the cell does not tell its state's shape (no `hidden_size` "
                "or `init_state`): pass `h0`"
            )
        return state

    def step(self, x: Array, h: PyTree[Array]) -> tuple[PyTree[Array], PyTree[Array]]:
        """One step of the layer, for generation and streams: the same cell and
        output as `__call__`, one input at a time.

        **Arguments:**

        - `x`: the input of one step, shape `(in_features,)`.
        - `h`: the state before it (`init_state()`, or the `final_state` of a call
            with `return_state=True`).

        **Returns:**

        `(output, h_next)`: the step's output (as one step of `__call__`'s outputs)
        and the new state.

        **Raises:**

        `ValueError` at trace time when `x` is not `(in_features,)` or `h` is not
        shaped like the cell's state.
        """
        want = self._in_features
        shape = jnp.shape(x)
        if len(shape) != 1 or (isinstance(want, int) and shape[0] != want):
            want = want if isinstance(want, int) else "in_features"
            raise ValueError(
                f"{self._name}.step: `x` must have shape ({want},) (one step of one "
                f"sequence: jax.vmap `step` for a batch), got {shape}"
            )
        x = jnp.asarray(x)
        self._check_state("h", h, x.dtype)
        h_next = self.cell(x, h)
        return _output(self.cell, x, h_next), h_next

    @property
    def _in_features(self):
        """The cell's input size where it says (Equinox's and pscan's cells), else
        None."""
        cell = self.cell
        return getattr(cell, "in_features", getattr(cell, "input_size", None))

    def _check_state(self, argument, h, dtype):
        """Raises a `ValueError` unless `h` is shaped like the cell's state (where the
        cell says what that is)."""
        default = _zeros_state(self.cell, dtype)
        if default is not None and _shapes(h) != _shapes(default):
            raise ValueError(
                f"{self._name}: `{argument}` must be shaped like the cell's state "
                f"{_shapes(default)}, got {_shapes(h)}"
            )

    def __call__(
        self,
        xs: Array,
        h0: PyTree[Array] | None = None,
        *,
        length: Int[ArrayLike, ""] | None = None,
        resets: Bool[ArrayLike, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> PyTree[Array] | tuple[PyTree[Array], PyTree[Array]]:
        """Runs the cell over the sequence.

        **Arguments:**

        - `xs`: one sequence, shape `(T, in_features)` with `T >= 1`.
        - `h0`: the state before the first step processed; by default
            `init_state()` (zeros; `(zeros, zeros)` for `eqx.nn.LSTMCell`).
        - `length`: None, or the number of real steps of a right-padded sequence (an
            integer scalar, traced under `jax.vmap`): steps at and after it leave the
            state unchanged and output zeros; with `reverse=True` the layer runs
            backward from step `length - 1`.
        - `resets`: None, or a boolean array `(T,)` marking where the segments of a
            packed sequence start: each segment runs from `h0` as if alone (with
            `reverse=True`, backward from its last step).
        - `key`: ignored (Equinox layers take one, so that `eqx.nn.Sequential` can
            pass it on).

        **Returns:**

        The output after every step, with a leading axis of length `T`; with
        `return_state=True`, `(outputs, final_state)`.

        **Raises:**

        `ValueError` at trace time when `xs` is not `(T, in_features)`, `h0` is not
        shaped like the cell's state, or `length` / `resets` do not fit.
        """
        outputs, state = self._run(xs, h0, length, resets, self.reverse)
        return (outputs, state) if self.return_state else outputs

    def _run(self, xs, h0, length, resets, reverse):
        """`(outputs, final_state)` of a pass over `xs` in the direction `reverse`."""
        name = self._name
        features = self._in_features
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
        if h0 is None:
            h0 = self.init_state(xs.dtype)
        else:
            self._check_state("h0", h0, xs.dtype)
        state_dtype = jax.tree_util.tree_leaves(h0)[0].real.dtype
        if jnp.issubdtype(xs.dtype, jnp.floating) and (
            jnp.finfo(xs.dtype).bits > jnp.finfo(state_dtype).bits
        ):
            raise ValueError(
                f"{name}: `xs` has dtype {xs.dtype} but the cell's state is "
                f"{state_dtype}: cast `xs` to {state_dtype}, or build the cell with "
                f"`dtype={xs.dtype}`"
            )
        # the layer's own name in the errors of `resets` and `length`
        resets, length = check_segments(
            name.removeprefix("pscan."), shape[0], resets, length
        )
        masks = dict(reverse=reverse, resets=resets, length=length)
        if length is not None:
            valid = jnp.arange(shape[0]) < length
            padded_to_zero = lambda y: jnp.where(
                along_time(valid, y), y, jnp.zeros((), y.dtype)
            )
            # padded steps read zeros: their outputs and states are discarded, and
            # so are their derivatives, but only if finite (NaN padding: 0 * NaN)
            xs = padded_to_zero(xs)
        if isinstance(self.cell, AbstractLinearCell) and self.solver is None:
            a, b = self.cell.coefficients(xs)
            hs = linear_recurrence(a, b, h0, **masks)
        else:
            solver = self.solver
            if solver is None:
                solver = default_solver(shape[0], state_dtype)
            hs = recurrence(
                self.cell, xs, h0, solver=solver, throw=self.throw, **masks
            ).hs
        final = jax.tree_util.tree_map(lambda h: h[0] if reverse else h[-1], hs)
        outputs = jax.vmap(lambda x, h: _output(self.cell, x, h))(xs, hs)
        if length is not None:  # padded steps output zeros
            outputs = jax.tree_util.tree_map(padded_to_zero, outputs)
        return outputs, final


class Bidirectional(eqx.Module):
    """A forward and a backward pass over one sequence, their outputs concatenated on
    the last axis (Flax's `Bidirectional`): `[forward_layer(xs), backward(xs)]`,
    where the backward layer runs from the last real step to the first whatever its
    own `reverse` (respecting `length` and `resets` as `pscan.nn.Recurrence` does).

    **Arguments:**

    - `forward_layer`: a `pscan.nn.Recurrence`, run forward.
    - `backward_layer`: a `pscan.nn.Recurrence`, run backward.
    - `return_state`: return `(outputs, (forward_state, backward_state))`.
    """

    forward_layer: Recurrence
    backward_layer: Recurrence
    return_state: bool = eqx.field(static=True, default=False, kw_only=True)

    def __check_init__(self):
        check_flag("nn.Bidirectional", "return_state", self.return_state)
        for name in ("forward_layer", "backward_layer"):
            layer = getattr(self, name)
            if not isinstance(layer, Recurrence):
                raise ValueError(
                    f"pscan.nn.Bidirectional: `{name}` must be a pscan.nn.Recurrence, "
                    f"got {type(layer).__name__}"
                )

    def __call__(
        self,
        xs: Array,
        h0: tuple[PyTree[Array], PyTree[Array]] | None = None,
        *,
        length: Int[ArrayLike, ""] | None = None,
        resets: Bool[ArrayLike, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Array | tuple[Array, tuple[PyTree[Array], PyTree[Array]]]:
        """Runs both passes.

        **Arguments:**

        - `xs`: one sequence, shape `(T, in_features)`.
        - `h0`: None, or `(forward_h0, backward_h0)`.
        - `length`, `resets`, `key`: as for `pscan.nn.Recurrence`.

        **Returns:**

        The outputs `(T, forward_features + backward_features)`; with
        `return_state=True`, `(outputs, (forward_state, backward_state))`.
        """
        h_f, h_b = (None, None) if h0 is None else h0
        y_f, s_f = self.forward_layer._run(xs, h_f, length, resets, False)
        y_b, s_b = self.backward_layer._run(xs, h_b, length, resets, True)
        outputs = jnp.concatenate([y_f, y_b], axis=-1)
        return (outputs, (s_f, s_b)) if self.return_state else outputs
