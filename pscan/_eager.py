"""Calls outside any trace (eager mode), compiled once for a configuration."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax


def compiled_when_eager(fn: Callable) -> Callable:
    """`fn`, compiled once for each configuration when no argument is a tracer (the
    shapes and dtypes of its arrays and the rest of its arguments, as
    `eqx.filter_jit` keys them), and traced inline otherwise.

    Called eagerly, a solve that runs loops and custom rules is otherwise traced and
    compiled anew at every call, whatever the inputs (a `pscan.Newton(chunk_size=16)`
    solve of a GRU 2 -> 8 over 1000 steps: 0.58 s a call, 1 ms compiled). Under a
    transformation (`jax.jit`, `jax.grad`, `jax.vmap`, ...) it is part of the
    caller's trace, exactly as without this wrapper: a nested compiled call would
    change what reverse mode keeps (more memory in the gradient of a chunked solve)
    and hide the implicit rules' refusal of second derivatives, which then came out
    as zeros.

    A function among the arguments is part of the configuration: what it reads
    besides its arguments (a global array) is read when the program is compiled, as
    under `jax.jit`. So user functions that may read such values go to `fn` itself
    (`__wrapped__`) unless `compiles_once` says otherwise.

    **Arguments:**

    - `fn`: a function of positional arguments (pytrees).

    **Returns:**

    A function with `fn`'s signature; `fn` itself as its `__wrapped__`.
    """
    compiled = eqx.filter_jit(fn)

    @functools.wraps(fn)
    def call(*args):
        leaves = jax.tree_util.tree_leaves(args)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return fn(*args)
        return compiled(*args)

    return call


def compiles_once(fn: Callable) -> bool:
    """Whether a user's callable can be compiled into a program that later calls
    reuse: an Equinox module (its arrays are leaves, passed anew at every call) or a
    function of JAX itself (`jnp.maximum`). A plain function is not: it may read a
    global array that a notebook reassigns between calls (`W = ...; def cell(x, h):
    return jnp.tanh(W @ h + x)`), which a compiled program would keep from its first
    call: a stale answer, silently."""
    if isinstance(fn, eqx.Module):
        return True
    module = getattr(fn, "__module__", None) or ""
    return module == "jax" or module.startswith("jax.")
