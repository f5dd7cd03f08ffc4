"""minGRU and minLSTM (Feng et al., "Were RNNs all we needed?", 2024): gates that depend
on the input only, so the state update is linear and runs as one linear recurrence."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._arguments import check_positive_int
from .._cell import AbstractLinearCell
from ._init import floating


class _MinRNN(AbstractLinearCell):
    """One `eqx.nn.Linear` computes every gate and the candidate state at once."""

    linear: eqx.nn.Linear
    in_features: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    projections: ClassVar[int]

    def __init__(
        self, in_features: int, hidden_size: int, *, dtype=None, key: PRNGKeyArray
    ):
        owner = f"nn.{type(self).__name__}"
        check_positive_int(owner, "in_features", in_features)
        check_positive_int(owner, "hidden_size", hidden_size)
        size = self.projections * hidden_size
        self.linear = eqx.nn.Linear(in_features, size, dtype=floating(dtype), key=key)
        self.in_features = in_features
        self.hidden_size = hidden_size

    def _project_all(self, xs):
        return jnp.split(jax.vmap(self.linear)(xs), self.projections, axis=-1)

    def init_state(self) -> Float[Array, " hidden"]:
        return jnp.zeros(self.hidden_size, self.linear.weight.dtype)


class MinGRU(_MinRNN):
    """minGRU: `z = sigmoid(W_z x)`, `h_next = (1 - z) * h + z * (W_h x)`.

    **Arguments:**

    - `in_features`: size of each input.
    - `hidden_size`: size of the state.
    - `dtype`: parameter dtype (default: float32, or float64 under `jax_enable_x64`).
    - `key`: a `jax.random.PRNGKey` for the initialisation (`eqx.nn.Linear`'s, one
        layer for `W_z` and `W_h` stacked).
    """

    projections: ClassVar[int] = 2

    def coefficients(
        self, xs: Float[Array, "T in"]
    ) -> tuple[Float[Array, "T hidden"], Float[Array, "T hidden"]]:
        gate, candidate = self._project_all(xs)
        z = jax.nn.sigmoid(gate)
        return 1 - z, z * candidate


class MinLSTM(_MinRNN):
    """minLSTM: forget and input gates `f = sigmoid(W_f x)`, `i = sigmoid(W_i x)`,
    normalised to sum to one, `h_next = f/(f+i) * h + i/(f+i) * (W_h x)`.

    **Arguments:**

    - `in_features`: size of each input.
    - `hidden_size`: size of the state.
    - `dtype`: parameter dtype (default: float32, or float64 under `jax_enable_x64`).
    - `key`: a `jax.random.PRNGKey` for the initialisation (`eqx.nn.Linear`'s, one
        layer for `W_f`, `W_i` and `W_h` stacked).
    """

    projections: ClassVar[int] = 3

    def coefficients(
        self, xs: Float[Array, "T in"]
    ) -> tuple[Float[Array, "T hidden"], Float[Array, "T hidden"]]:
        forget, inp, candidate = self._project_all(xs)
        # f / (f + i) with f = sigmoid(u), i = sigmoid(v), in log space for stability
        log_f = jax.nn.log_sigmoid(forget)
        log_i = jax.nn.log_sigmoid(inp)
        norm = jnp.logaddexp(log_f, log_i)
        return jnp.exp(log_f - norm), jnp.exp(log_i - norm) * candidate
