"""The seed scenario: an Elman network 32 -> 32 over a batch of 16 sequences, gradient
of the sum of all outputs with respect to the parameters; `pscan.nn.Recurrence` with its
default solver against a hand-written `lax.scan` of the same cell."""

import jax
import jax.lax as lax
import jax.numpy as jnp

import pscan.nn as nn

from ._common import compile_timed, run, sizes


def hand_written(cell, xs):
    def one(xs):
        def body(h, x):
            h = cell(x, h)
            return h, h

        return lax.scan(body, cell.init_state(), xs)[1]

    return jnp.sum(jax.vmap(one)(xs))


def layer(cell, xs):
    return jnp.sum(jax.vmap(nn.Recurrence(cell))(xs))


PROGRAMS = {"lax.scan": hand_written, "pscan.nn.Recurrence": layer}


class SeedScenario:
    params = (list(PROGRAMS), sizes([2**12, 2**15, 2**17, 2**19], [2**8]))
    param_names = ["program", "length"]
    timeout = 900
    number = 1
    repeat = (1, 5, 60.0)

    def setup(self, program, length):
        self.cell = nn.ElmanCell(32, 32, key=jax.random.PRNGKey(0), dtype=jnp.float32)
        self.xs = jax.random.normal(jax.random.PRNGKey(1), (16, length, 32))
        self.gradient, self.compile = compile_timed(
            jax.grad(PROGRAMS[program]), self.cell, self.xs
        )

    def time_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def peakmem_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def track_compile_gradient(self, *_):
        return self.compile

    track_compile_gradient.unit = "seconds"
