"""`pscan.linear_recurrence`: every method against a plain `lax.scan` (the in-suite
baseline, method "lax.scan"), forward and gradient with respect to `(a, b)`."""

import jax
import jax.lax as lax
import jax.numpy as jnp

import pscan

from ._common import compile_timed, run, sizes


def scan_baseline(a, b):
    def step(h, ab):
        h = ab[0] * h + ab[1]
        return h, h

    return lax.scan(step, jnp.zeros_like(b[0]), (a, b))[1]


def recurrence_fn(method):
    if method == "lax.scan":
        return scan_baseline
    return lambda a, b: pscan.linear_recurrence(a, b, method=method)


class LinearRecurrence:
    params = (
        ["lax.scan", "auto", "sequential", "chunked", "associative"],
        sizes([2**14, 2**17, 2**19], [2**10]),
        [1, 32],
    )
    param_names = ["method", "length", "channels"]
    timeout = 600
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, method, length, channels):
        ka, kb = jax.random.split(jax.random.PRNGKey(0))
        self.a = jax.random.uniform(ka, (length, channels), minval=0.5, maxval=0.99)
        self.b = jax.random.normal(kb, (length, channels))
        f = recurrence_fn(method)
        self.forward, self.forward_compile = compile_timed(f, self.a, self.b)
        loss = lambda a, b: jnp.sum(f(a, b) ** 2)
        self.gradient, self.gradient_compile = compile_timed(
            jax.grad(loss, argnums=(0, 1)), self.a, self.b
        )

    def time_forward(self, *_):
        run(self.forward, self.a, self.b)

    def time_gradient(self, *_):
        run(self.gradient, self.a, self.b)

    def peakmem_gradient(self, *_):
        run(self.gradient, self.a, self.b)

    def track_compile_forward(self, *_):
        return self.forward_compile

    def track_compile_gradient(self, *_):
        return self.gradient_compile

    track_compile_forward.unit = "seconds"
    track_compile_gradient.unit = "seconds"
