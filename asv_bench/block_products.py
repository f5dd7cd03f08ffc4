"""pscan's products of small blocks (`pscan/_blocks.py`) both ways on this machine: the
matrix units' `jnp.matmul` at full precision against the elementwise multiply-and-sum
that a TPU takes for blocks up to 32 wide. Run time (median of 7 rounds of 20 calls of
the compiled program) and compile time (trace, lower and compile), for the products
alone, the dense linear recurrence, and DEER's and `ELK(chunk_size=128)`'s forward and
gradient on a GRU 1 -> 32.

    python asv_bench/block_products.py            # on a TPU: the two ways it can take
    python asv_bench/block_products.py --length 16384

On other backends both rows run `jnp.matmul` unless `--as-tpu` traces pscan's TPU paths
(elementwise products) for comparison.
"""

import argparse
import time

import jax
import jax.numpy as jnp
from benchmarks.measure import print_table
from benchmarks.scenarios import gru_problem, solver_programs

import pscan
import pscan._blocks as blocks


def _timed(fn, args):
    """`(ms per call, compile s)` of `jit(fn)(*args)`, compiled afresh."""
    jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            out = compiled(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / 20)
    return sorted(rounds)[3] * 1e3, compile_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=100000, help="T of the scans")
    parser.add_argument("--as-tpu", action="store_true", help="trace pscan's TPU paths")
    args = parser.parse_args()
    if args.as_tpu:
        jax.default_backend = lambda: "tpu"
    key = jax.random.PRNGKey(0)
    cases = []
    for k, d in [(782, 32), (3125, 16), (100, 32), (782, 8)]:
        a = jax.random.normal(key, (k, d, d)) / d**0.5
        cases.append((f"product of {k} blocks {d} x {d}", blocks.block_matmul, (a, a)))
    t, d = args.length, 32
    a = jax.random.normal(key, (t, d, d)) * (0.9 / (2 * d) ** 0.5)
    b = jax.random.normal(jax.random.PRNGKey(1), (t, d))
    linear = lambda a, b: pscan.linear_recurrence(a, b, jnp.zeros(d))
    grad = jax.grad(lambda a, b: jnp.sum(linear(a, b) ** 2), argnums=(0, 1))
    cases += [
        (f"dense linear_recurrence, T = {t}, forward", linear, (a, b)),
        (f"dense linear_recurrence, T = {t}, gradient", grad, (a, b)),
    ]
    cell, xs, h0 = gru_problem(t, d)
    tol = dict(rtol=1e-5, atol=1e-5)
    for name, solver in [
        ("DEER", pscan.Newton(**tol)),
        ("ELK(chunk_size=128)", pscan.ELK(chunk_size=128, **tol)),
    ]:
        programs = solver_programs(solver, h0)
        cases += [
            (f"{name}, GRU 1 -> {d}, T = {t}, forward", programs["fwd"], (cell, xs)),
            (f"{name}, GRU 1 -> {d}, T = {t}, gradient", programs["grad"], (cell, xs)),
        ]
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}")
    rows = []
    widest = blocks._ELEMENTWISE_UP_TO
    for name, fn, fn_args in cases:
        row = [name]
        for up_to in (0, widest):  # the matrix units, then elementwise up to 32 wide
            blocks._ELEMENTWISE_UP_TO = up_to
            ms, compile_s = _timed(fn, fn_args)
            row += [f"{ms:.3f}", f"{compile_s:.2f}"]
        blocks._ELEMENTWISE_UP_TO = widest
        rows.append(row)
    header = [
        "program",
        "matmul (ms)",
        "its compile (s)",
        "elementwise (ms)",
        "its compile (s)",
    ]
    print_table(header, rows)


if __name__ == "__main__":
    main()
