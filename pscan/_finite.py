"""Finiteness checks (and any `all` over booleans) that compile small.

On XLA's CPU backend `jnp.all(jnp.isfinite(x), axis)` (a reduction over booleans)
emits about 60 kB of optimised LLVM IR for a `(782, 32)` array and adds ~30 ms to a
compile; a float reduction gives the same answer at about a tenth of that. The
solvers' loops check finiteness several times per iteration, so this is a visible
part of their compile time (see docs/benchmarks.md, "Compile time").

The reduction is a max over 1 where an entry is not finite and 0 where it is: the
values reduced are never NaN. A max of `|x|` compared with infinity would not do: XLA
CPU's vectorised max reduction drops NaNs (`jnp.max` of 16000 ones and one NaN gives
1.0 there), which made non-finite states pass as finite. (A sum of `|x| * 0` is
correct too, but held more memory: Newton(chunk_size=128)'s forward at T = 16384,
d = 128 took 21.3 MiB of XLA temp against 16.3.)
"""

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from ._axis import everywhere


def all_along(ok: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """`jnp.all(ok, axis)` for a bool array, as a float reduction: the max over 1
    where `ok` is False and 0 where it is True (no NaN among the values reduced)."""
    bad = jnp.where(ok, 0.0, 1.0).astype(jnp.float32)
    return jnp.max(bad, axis=axis, initial=0.0) == 0


def finite_along(x: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Whether every entry of `x` along `axis` (all of them for None) is finite: a
    bool array of `x`'s shape without `axis`."""
    return all_along(jnp.isfinite(x), axis)


def finite_everywhere(x: Array, axis_name: str | None) -> Array:
    """Whether every entry of `x` is finite, on every device along `axis_name`: a
    scalar bool, the same on all of them."""
    finite = finite_along(x).astype(jnp.int32)
    return everywhere(finite, axis_name, lax.pmin) > 0
