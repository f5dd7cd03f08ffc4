"""`pscan.recurrence` on a GRU cell (1 -> 32): every solver's forward, gradient and
iteration count; `Sequential` is a plain `lax.scan`."""

import equinox as eqx
import jax
import jax.numpy as jnp

import pscan

from ._common import compile_timed, run, sizes


TOL = dict(rtol=1e-5, atol=1e-5)
SOLVERS = {
    "Sequential": pscan.Sequential(),
    "Sequential(checkpoint=256)": pscan.Sequential(checkpoint=256),
    "Picard(chunk_size=256)": pscan.Picard(chunk_size=256, **TOL),
    "Newton(chunk_size=256)": pscan.Newton(chunk_size=256, **TOL),
    "Newton(chunk_size=256, diagonal)": pscan.Newton(
        chunk_size=256, jacobian="diagonal", **TOL
    ),
    "Newton() = DEER": pscan.Newton(**TOL),
}


class GRUSolvers:
    params = (list(SOLVERS), sizes([2**12, 2**16], [2**9]))
    param_names = ["solver", "length"]
    timeout = 600
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, solver, length):
        hidden = 32
        self.cell = eqx.nn.GRUCell(1, hidden, key=jax.random.PRNGKey(0))
        self.xs = jax.random.normal(jax.random.PRNGKey(1), (length, 1))
        h0 = jnp.zeros(hidden)
        s = SOLVERS[solver]
        solve = lambda c, xs: pscan.recurrence(c, xs, h0, solver=s, throw=False)
        self.forward, self.forward_compile = compile_timed(
            lambda c, xs: solve(c, xs).hs, self.cell, self.xs
        )
        grad = eqx.filter_grad(lambda c, xs: jnp.sum(solve(c, xs).hs))
        self.gradient, self.gradient_compile = compile_timed(
            lambda c, xs: grad(c, xs), self.cell, self.xs
        )
        self.iterations = int(jax.jit(solve)(self.cell, self.xs).stats["num_iterations"])

    def time_forward(self, *_):
        run(self.forward, self.cell, self.xs)

    def time_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def peakmem_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def track_iterations(self, *_):
        return self.iterations

    def track_compile_gradient(self, *_):
        return self.gradient_compile

    track_iterations.unit = "iterations"
    track_compile_gradient.unit = "seconds"
