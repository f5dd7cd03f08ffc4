"""pscan's products of small blocks (`pscan/_blocks.py`) both ways on this machine: the
matrix units' `jnp.matmul` at full precision against the elementwise multiply-and-sum
that a TPU takes for blocks up to 32 wide. Run time (median of interleaved calls of
the two compiled programs) and compile time (lower and compile), for the products
alone, the dense linear recurrence, and DEER's and `ELK(chunk_size=128)`'s forward
and gradient on a GRU 1 -> 32.

    python asv_bench/block_products.py            # on a TPU: the two ways it can take
    python asv_bench/block_products.py --length 16384

On other backends both rows run `jnp.matmul` unless `--as-tpu` traces pscan's TPU paths
(elementwise products) for comparison.
"""

import argparse

import jax
import jax.numpy as jnp
from benchmarks.measure import compile_timed, interleaved_medians, print_table
from benchmarks.scenarios import gru_problem, solver_programs

import pscan
import pscan._blocks as blocks


def _both_ways(fn, args, repeats):
    """`(ms, compile s)` of `jit(fn)(*args)` with the matrix units' products, then with
    the elementwise ones, each compiled afresh, timed in interleaved rounds."""
    widest = blocks._ELEMENTWISE_UP_TO
    compiled = {}
    for up_to in (0, widest):  # the matrix units, then elementwise up to 32 wide
        blocks._ELEMENTWISE_UP_TO = up_to
        jax.clear_caches()
        compiled[up_to] = compile_timed(fn, *args)
    blocks._ELEMENTWISE_UP_TO = widest
    med = interleaved_medians(compiled, *args, repeats=repeats)
    return [(med[k] * 1e3, compiled[k][1]) for k in (0, widest)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=100000, help="T of the scans")
    parser.add_argument("--repeats", type=int, default=51, help="interleaved rounds")
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
    for name, fn, fn_args in cases:
        row = [name]
        for ms, compile_s in _both_ways(fn, fn_args, args.repeats):
            row += [f"{ms:.3f}", f"{compile_s:.2f}"]
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
