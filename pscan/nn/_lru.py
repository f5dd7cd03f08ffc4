import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Complex, Float, PRNGKeyArray

from .._arguments import check_positive_int
from .._cell import AbstractLinearCell
from ._init import floating


class LRU(AbstractLinearCell):
    """The Linear Recurrent Unit (Orvieto et al., "Resurrecting recurrent neural
    networks for long sequences", 2023).

    A complex diagonal recurrence with an exponential parametrisation of its
    eigenvalues, `lambda = exp(-exp(nu_log) + i exp(theta_log))` (so `|lambda| < 1`
    always), input normalisation `gamma = sqrt(1 - |lambda|^2)` and a real readout:

    `h_next = lambda * h + exp(gamma_log) * (B x)`, `y = Re(C h_next) + D * x`.

    `lambda` is shared by every step, so `pscan.linear_recurrence` never materialises it
    over time. `pscan.nn.Recurrence(LRU(...))` returns the real outputs `y`.

    **Arguments:**

    - `in_features`: size of each input, and of each output.
    - `state_size`: number of complex states.
    - `r_min`, `r_max`: the eigenvalue moduli are initialised uniformly on the ring
        `r_min <= |lambda| <= r_max` (close to 1 remembers longer).
    - `max_phase`: the eigenvalue phases are initialised uniformly in `[0, max_phase]`.
    - `dtype`: real parameter dtype (default: float32, or float64 under
        `jax_enable_x64`); states are of the matching complex dtype.
    - `key`: a `jax.random.PRNGKey` for the initialisation.
    """

    nu_log: Float[Array, " state"]
    theta_log: Float[Array, " state"]
    gamma_log: Float[Array, " state"]
    b_re: Float[Array, "state in"]
    b_im: Float[Array, "state in"]
    c_re: Float[Array, "in state"]
    c_im: Float[Array, "in state"]
    d: Float[Array, " in"]
    in_features: int = eqx.field(static=True)
    state_size: int = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        state_size: int,
        *,
        r_min: float = 0.9,
        r_max: float = 0.999,
        max_phase: float = 2 * math.pi,
        dtype=None,
        key: PRNGKeyArray,
    ):
        check_positive_int("nn.LRU", "in_features", in_features)
        check_positive_int("nn.LRU", "state_size", state_size)
        if not 0 <= r_min < r_max <= 1:
            raise ValueError(
                f"pscan.nn.LRU: need 0 <= r_min < r_max <= 1, got r_min={r_min}, r_max={r_max}"
            )
        dtype = floating(dtype)
        k = jax.random.split(key, 7)
        u1 = jax.random.uniform(k[0], (state_size,), dtype)
        u2 = jax.random.uniform(k[1], (state_size,), dtype)
        self.nu_log = jnp.log(-0.5 * jnp.log(u1 * (r_max**2 - r_min**2) + r_min**2))
        self.theta_log = jnp.log(max_phase * u2)
        modulus = jnp.exp(-jnp.exp(self.nu_log))
        self.gamma_log = jnp.log(jnp.sqrt(1 - modulus**2))
        scale_b = (2 * in_features) ** -0.5
        self.b_re = scale_b * jax.random.normal(k[2], (state_size, in_features), dtype)
        self.b_im = scale_b * jax.random.normal(k[3], (state_size, in_features), dtype)
        scale_c = state_size**-0.5
        self.c_re = scale_c * jax.random.normal(k[4], (in_features, state_size), dtype)
        self.c_im = scale_c * jax.random.normal(k[5], (in_features, state_size), dtype)
        self.d = jax.random.normal(k[6], (in_features,), dtype)
        self.in_features = in_features
        self.state_size = state_size

    def eigenvalues(self) -> Complex[Array, " state"]:
        """`lambda = exp(-exp(nu_log) + i exp(theta_log))`, the diagonal of the
        recurrence.

        **Returns:**

        The complex eigenvalues, all of modulus below one.
        """
        return jnp.exp(-jnp.exp(self.nu_log) + 1j * jnp.exp(self.theta_log))

    def coefficients(
        self, xs: Float[Array, "T in"]
    ) -> tuple[Complex[Array, " state"], Complex[Array, "T state"]]:
        bu = xs @ self.b_re.T + 1j * (xs @ self.b_im.T)
        return self.eigenvalues(), jnp.exp(self.gamma_log) * bu

    def readout(
        self, x: Float[Array, " in"], h: Complex[Array, " state"]
    ) -> Float[Array, " in"]:
        return self.c_re @ h.real - self.c_im @ h.imag + self.d * x

    def init_state(self) -> Complex[Array, " state"]:
        return jnp.zeros(self.state_size, jnp.result_type(self.nu_log.dtype, 1j))
