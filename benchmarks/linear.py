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
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.lax as lax
import jax.numpy as jnp

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


def _status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def child(args):
    """Runs one (candidate, program) in this fresh process and reports its peak RSS.

    The program is compiled and run once first; then the kernel's high-water mark is
    reset (Linux `clear_refs`) so the figure is the peak while executing, inputs and
    outputs included, without the compiler's own memory.
    """
    a, b = problem(args.length, args.state, args.dtype)
    exe = jax.jit(programs(args.child_name)[args.child_program]).lower(a, b).compile()
    jax.block_until_ready(exe(a, b))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_mib("VmRSS")
    jax.block_until_ready(exe(a, b))
    print(json.dumps({"peak_rss_mib": _status_mib("VmHWM"), "before_mib": base}))


def peak_rss(args, name, program):
    cmd = [
        sys.executable, __file__, "--length", str(args.length), "--state",
        str(args.state), "--dtype", args.dtype, "--child-name", name,
        "--child-program", program,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]


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
    compiled, compile_s, temp_mib = {}, {}, {}
    for name in names:
        for program, fn in programs(name).items():
            t0 = time.perf_counter()
            exe = jax.jit(fn).lower(a, b).compile()
            compile_s[name, program] = time.perf_counter() - t0
            temp_mib[name, program] = exe.memory_analysis().temp_size_in_bytes / 2**20
            jax.block_until_ready(exe(a, b))  # warm up
            compiled[name, program] = exe
    times = {key: [] for key in compiled}
    for _ in range(args.repeats):
        for key, exe in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(exe(a, b))
            times[key].append(time.perf_counter() - t0)

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
    for name, program in compiled:
        t = statistics.median(times[name, program])
        base = statistics.median(times["lax.scan", program])
        row = (
            f"| {name} | {program} | {t * 1e3:.1f} | {t / base:.2f}x | "
            f"{compile_s[name, program]:.2f} | {temp_mib[name, program]:.0f} |"
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
