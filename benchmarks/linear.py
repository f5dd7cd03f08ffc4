"""Benchmark `pscan.linear_recurrence` against a plain `lax.scan`, in one run.

    python benchmarks/linear.py                      # T = 524288, d = 32, float32
    python benchmarks/linear.py --length 16384 --state 1 --methods chunked

Every candidate is compiled first (compile time reported), then the compiled forward
and gradient (with respect to `a` and `b`, of `sum(hs)`) are timed in interleaved
rounds so that machine noise hits all candidates alike; the table reports the median
and the ratio to the plain scan measured in the same rounds. Memory is the peak RSS of
a fresh process that compiles and runs one candidate once, and XLA's own temp-buffer
figure from the compiled program.
"""

import argparse

import jax
import jax.lax as lax
import jax.numpy as jnp
from _measure import compile_all, interleaved_medians, peak_rss_of, report_peak_rss

import pscan


def plain_scan(a, b):
    """The obvious sequential implementation a user would write."""

    def step(h, ab):
        a_t, b_t = ab
        h = a_t * h + b_t
        return h, h

    return lax.scan(step, jnp.zeros(b.shape[1:], b.dtype), (a, b))[1]


def candidate(name):
    if name == "lax.scan":
        return plain_scan
    method, _, chunk = name.partition(":")
    chunk_size = int(chunk) if chunk else None
    return lambda a, b: pscan.linear_recurrence(a, b, method=method, chunk_size=chunk_size)


def programs(name):
    fwd = candidate(name)
    grad = jax.grad(lambda a, b: jnp.sum(fwd(a, b)), argnums=(0, 1))
    return {"fwd": fwd, "grad": grad}


def problem(length, state, dtype):
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.uniform(ka, (length, state), dtype, 0.5, 0.999)
    b = jax.random.normal(kb, (length, state), dtype)
    return a, b


def child(args):
    """Peak RSS of one (candidate, program), run in this fresh process."""
    a, b = problem(args.length, args.state, args.dtype)
    report_peak_rss(programs(args.child_name)[args.child_program], a, b)


def peak_rss(args, name, program):
    return peak_rss_of(
        __file__, "--length", str(args.length), "--state", str(args.state),
        "--dtype", args.dtype, "--child-name", name, "--child-program", program,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=524288)
    parser.add_argument("--state", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--methods", default="auto,sequential,chunked,associative",
        help="comma-separated; `chunked:C` sets the chunk size",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip peak-RSS runs")
    parser.add_argument("--child-name", help=argparse.SUPPRESS)
    parser.add_argument("--child-program", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_name:
        return child(args)

    a, b = problem(args.length, args.state, args.dtype)
    names = ["lax.scan", *args.methods.split(",")]
    compiled = compile_all(
        {(n, p): fn for n in names for p, fn in programs(n).items()}, a, b
    )
    medians = interleaved_medians(compiled, a, b, repeats=args.repeats)

    print(
        f"# linear recurrence T={args.length} d={args.state} {args.dtype}, "
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"median of {args.repeats} interleaved runs"
    )
    header = "| method | program | time (ms) | vs lax.scan | compile (s) | XLA temp (MiB) |"
    if not args.no_memory:
        header += " peak RSS (MiB) | RSS vs lax.scan |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rss = {}
    for (name, program), (_, compile_s, temp_mib) in compiled.items():
        t, base = medians[name, program], medians["lax.scan", program]
        row = (
            f"| {name} | {program} | {t * 1e3:.1f} | {t / base:.2f}x | "
            f"{compile_s:.2f} | {temp_mib:.0f} |"
        )
        if not args.no_memory:
            rss[name, program] = peak_rss(args, name, program)
            row += (
                f" {rss[name, program]:.0f} | "
                f"{rss[name, program] / rss['lax.scan', program]:.2f}x |"
            )
        print(row, flush=True)


if __name__ == "__main__":
    main()
