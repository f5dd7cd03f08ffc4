"""Finiteness checks that compile small.

On XLA's CPU backend `jnp.all(jnp.isfinite(x), axis)` (a reduction over booleans)
emits about 60 kB of optimised LLVM IR for a `(782, 32)` array and adds ~30 ms to a
compile; the largest magnitude compared with infinity (`max` propagates NaN) gives the
same answer from a float reduction at about a tenth of that. The solvers' loops check
finiteness several times per iteration, so this is a visible part of their compile
time (see docs/benchmarks.md, "Compile time").
"""

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from ._axis import everywhere


def finite_along(x: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Whether every entry of `x` along `axis` (all of them for None) is finite: a
    bool array of `x`'s shape without `axis`."""
    return jnp.max(jnp.abs(x), axis=axis, initial=0.0) < jnp.inf


def finite_everywhere(x: Array, axis_name: str | None) -> Array:
    """Whether every entry of `x` is finite, on every device along `axis_name`: a
    scalar bool, the same on all of them."""
    finite = finite_along(x).astype(jnp.int32)
    return everywhere(finite, axis_name, lax.pmin) > 0
