"""minGRU and minLSTM (Feng et al., "Were RNNs all we needed?", 2024): gates that depend
on the input only, so the state update is linear and runs as one linear recurrence."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._cell import AbstractLinearCell
from ._init import floating


def _linear(in_features, out_features, dtype, key):
    return eqx.nn.Linear(in_features, out_features, dtype=dtype, key=key)


class MinGRU(AbstractLinearCell):
    """minGRU: `z = sigmoid(W_z x)`, `h_next = (1 - z) * h + z * (W_h x)`.

    **Arguments:**

    - `in_features`: size of each input.
    - `hidden_size`: size of the state.
    - `dtype`: parameter dtype (default: float32, or float64 under `jax_enable_x64`).
    - `key`: a `jax.random.PRNGKey` for the initialisation (`eqx.nn.Linear`'s).
    """

    linear_z: eqx.nn.Linear
    linear_h: eqx.nn.Linear
    in_features: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)

    def __init__(
        self, in_features: int, hidden_size: int, *, dtype=None, key: PRNGKeyArray
    ):
        dtype = floating(dtype)
        kz, kh = jax.random.split(key)
        self.linear_z = _linear(in_features, hidden_size, dtype, kz)
        self.linear_h = _linear(in_features, hidden_size, dtype, kh)
        self.in_features = in_features
        self.hidden_size = hidden_size

    def coefficients(
        self, xs: Float[Array, "T in"]
    ) -> tuple[Float[Array, "T hidden"], Float[Array, "T hidden"]]:
        z = jax.nn.sigmoid(jax.vmap(self.linear_z)(xs))
        candidate = jax.vmap(self.linear_h)(xs)
        return 1 - z, z * candidate

    def init_state(self) -> Float[Array, " hidden"]:
        return jnp.zeros(self.hidden_size, self.linear_h.weight.dtype)


class MinLSTM(AbstractLinearCell):
    """minLSTM: forget and input gates `f = sigmoid(W_f x)`, `i = sigmoid(W_i x)`,
    normalised to sum to one, `h_next = f/(f+i) * h + i/(f+i) * (W_h x)`.

    **Arguments:**

    - `in_features`: size of each input.
    - `hidden_size`: size of the state.
    - `dtype`: parameter dtype (default: float32, or float64 under `jax_enable_x64`).
    - `key`: a `jax.random.PRNGKey` for the initialisation (`eqx.nn.Linear`'s).
    """

    linear_f: eqx.nn.Linear
    linear_i: eqx.nn.Linear
    linear_h: eqx.nn.Linear
    in_features: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)

    def __init__(
        self, in_features: int, hidden_size: int, *, dtype=None, key: PRNGKeyArray
    ):
        dtype = floating(dtype)
        kf, ki, kh = jax.random.split(key, 3)
        self.linear_f = _linear(in_features, hidden_size, dtype, kf)
        self.linear_i = _linear(in_features, hidden_size, dtype, ki)
        self.linear_h = _linear(in_features, hidden_size, dtype, kh)
        self.in_features = in_features
        self.hidden_size = hidden_size

    def coefficients(
        self, xs: Float[Array, "T in"]
    ) -> tuple[Float[Array, "T hidden"], Float[Array, "T hidden"]]:
        # f / (f + i) with f = sigmoid(u), i = sigmoid(v), computed stably in log space
        log_f = jax.nn.log_sigmoid(jax.vmap(self.linear_f)(xs))
        log_i = jax.nn.log_sigmoid(jax.vmap(self.linear_i)(xs))
        norm = jnp.logaddexp(log_f, log_i)
        candidate = jax.vmap(self.linear_h)(xs)
        return jnp.exp(log_f - norm), jnp.exp(log_i - norm) * candidate

    def init_state(self) -> Float[Array, " hidden"]:
        return jnp.zeros(self.hidden_size, self.linear_h.weight.dtype)
