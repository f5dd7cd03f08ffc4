"""Helpers shared by the benchmarks: compile in `setup`, time the compiled call."""

import os
import time

import jax


SMOKE = os.environ.get("PSCAN_ASV_SMOKE", "") not in ("", "0")


def sizes(full, smoke):
    """The parameter values: `smoke` when `PSCAN_ASV_SMOKE` is set."""
    return smoke if SMOKE else full


def compile_timed(fn, *args):
    """`(compiled, seconds)`: `jax.jit(fn)` lowered and compiled for `args`, and
    warmed up once so that timings see neither tracing nor first-call allocation."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    return compiled, seconds


def run(compiled, *args):
    """One call, finished."""
    jax.block_until_ready(compiled(*args))
