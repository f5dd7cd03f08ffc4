import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._arguments import check_positive_int
from .._cell import AbstractCell
from ._init import floating, uniform


class ElmanCell(AbstractCell):
    """The Elman network, `h_next = tanh(W x + U h + b)` (PyTorch's `nn.RNNCell`,
    Lux's `RNNCell`, Flax's `SimpleCell`).

    The input term `W x + b` is the cell's `project`: pscan computes it for a whole
    block of steps in one matrix product and loops only over `tanh(z + U h)`.

    **Arguments:**

    - `in_features`: size of each input.
    - `hidden_size`: size of the state.
    - `use_bias`: whether to add `b`.
    - `activation`: the nonlinearity (default `jnp.tanh`).
    - `dtype`: parameter dtype (default: float32, or float64 under `jax_enable_x64`).
    - `key`: a `jax.random.PRNGKey` for the initialisation, uniform on
        `[-1/sqrt(hidden_size), 1/sqrt(hidden_size)]` as in PyTorch.
    """

    weight_ih: Float[Array, "hidden in"]
    weight_hh: Float[Array, "hidden hidden"]
    bias: Float[Array, " hidden"] | None
    in_features: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    activation: object = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        *,
        use_bias: bool = True,
        activation=jnp.tanh,
        dtype=None,
        key: PRNGKeyArray,
    ):
        check_positive_int("nn.ElmanCell", "in_features", in_features)
        check_positive_int("nn.ElmanCell", "hidden_size", hidden_size)
        dtype = floating(dtype)
        k1, k2, k3 = jax.random.split(key, 3)
        bound = hidden_size**-0.5
        self.weight_ih = uniform(k1, (hidden_size, in_features), bound, dtype)
        self.weight_hh = uniform(k2, (hidden_size, hidden_size), bound, dtype)
        self.bias = uniform(k3, (hidden_size,), bound, dtype) if use_bias else None
        self.in_features = in_features
        self.hidden_size = hidden_size
        self.activation = activation

    def project(self, x: Float[Array, " in"]) -> Float[Array, " hidden"]:
        z = self.weight_ih @ x
        return z if self.bias is None else z + self.bias

    def step(
        self, z: Float[Array, " hidden"], h: Float[Array, " hidden"]
    ) -> Float[Array, " hidden"]:
        return self.activation(z + self.weight_hh @ h)

    def init_state(self) -> Float[Array, " hidden"]:
        return jnp.zeros(self.hidden_size, self.weight_hh.dtype)
