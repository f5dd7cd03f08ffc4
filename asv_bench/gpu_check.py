"""The GPU check: one script, a few minutes on one accelerator, one table.

    python asv_bench/gpu_check.py                    # T = 524288, batch 16, d = 32
    python asv_bench/gpu_check.py --length 4096 --gru-length 4096   # quick, any backend

Measures, against sequential `lax.scan` on the same device, in one run (median of
`--repeats` timed calls of compiled programs, compile outside the timing):

1. the linear recurrence `h[t] = a[t] * h[t-1] + b[t]` on (T, batch, d), forward and
   gradient with respect to (a, b), for every method (target on an H200: >= 100x);
2. a GRU cell 1 -> d: chunked `pscan.Newton` against `pscan.Sequential` (a plain
   `lax.scan`), forward and gradient (target: >= 10x);
3. the achieved bandwidth of the chunked forward: the bytes it must move (read a and b,
   write hs) over its time, against a device copy that moves as many bytes
   (target: >= 50%).
"""

import argparse
import time

import jax
import jax.numpy as jnp
from benchmarks.measure import (  # asv_bench/benchmarks
    compile_timed,
    interleaved_medians,
)
from benchmarks.scenarios import (
    LINEAR_METHODS,
    gru_problem,
    gru_solvers,
    linear_problem,
    linear_programs,
    solver_programs,
)


def timed(fn, *args, repeats):
    """`(median seconds, compile seconds)` of `jax.jit(fn)` on `args`."""
    compiled, compile_s = compile_timed(fn, *args)
    med = interleaved_medians({0: (compiled, compile_s)}, *args, repeats=repeats)
    return med[0], compile_s


def linear_rows(args):
    a, b = linear_problem(args.length, args.hidden, batch=args.batch)
    rows, base = [], {}
    for name in LINEAR_METHODS:
        programs = linear_programs(name)
        fwd_s, fwd_c = timed(programs["fwd"], a, b, repeats=args.repeats)
        grad_s, grad_c = timed(programs["grad"], a, b, repeats=args.repeats)
        if name == "lax.scan":
            base = {"fwd": fwd_s, "grad": grad_s}
        rows.append(
            (
                name,
                fwd_s,
                base["fwd"] / fwd_s,
                fwd_c,
                grad_s,
                base["grad"] / grad_s,
                grad_c,
            )
        )
    return rows, a, b


def bandwidth_row(args, a, b):
    chunked = linear_programs("chunked")["fwd"]
    fwd_s, _ = timed(chunked, a, b, repeats=args.repeats)
    moved = a.nbytes + b.nbytes + b.nbytes  # read a, b; write hs
    # a copy reads and writes its array: copying moved / 2 bytes moves as many
    x = jnp.zeros(moved // 2 // 4, jnp.float32)
    copy_s, _ = timed(lambda x: x + 1, x, repeats=args.repeats)
    return moved, fwd_s, copy_s


def gru_rows(args):
    cell, xs, h0 = gru_problem(args.gru_length, args.hidden)
    every = gru_solvers(chunk=args.chunk)
    names = [
        "Sequential",
        f"Newton(chunk_size={args.chunk})",
        f"Picard(chunk_size={args.chunk})",
    ]
    reference = jax.jit(solver_programs(every["Sequential"], h0)["fwd"])(cell, xs)
    rows, base = [], {}
    for name in names:
        programs = solver_programs(every[name], h0)
        sol = jax.jit(programs["solve"])(cell, xs)
        iters = int(sol.stats["num_iterations"])
        err = float(jnp.max(jnp.abs(sol.hs - reference)))
        fwd_s, _ = timed(programs["fwd"], cell, xs, repeats=args.repeats)
        grad_s, _ = timed(programs["grad"], cell, xs, repeats=args.repeats)
        if not base:
            base = {"fwd": fwd_s, "grad": grad_s}
        rows.append(
            (
                name,
                iters,
                err,
                fwd_s,
                base["fwd"] / fwd_s,
                grad_s,
                base["grad"] / grad_s,
            )
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=524288)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--gru-length", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    device = jax.devices()[0]
    print(
        f"# pscan GPU check, {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, "
        f"{device.platform} {device.device_kind}"
    )
    rows, a, b = linear_rows(args)
    print(
        f"\n## Linear recurrence, T = {args.length}, batch {args.batch}, "
        f"d = {args.hidden}, float32 (speed-up = lax.scan time / method time)\n"
    )
    print(
        "| method | fwd (ms) | fwd speed-up | fwd compile (s) | grad (ms) "
        "| grad speed-up | grad compile (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, f, fs, fc, g, gs, gc in rows:
        print(
            f"| {name} | {f * 1e3:.2f} | {fs:.1f}x | {fc:.2f} | {g * 1e3:.2f} | "
            f"{gs:.1f}x | {gc:.2f} |",
            flush=True,
        )
    moved, fwd_s, copy_s = bandwidth_row(args, a, b)
    print(
        f"\n## Bandwidth of the chunked forward\n\n"
        f"moves {moved / 2**20:.0f} MiB in {fwd_s * 1e3:.2f} ms = "
        f"{moved / fwd_s / 1e9:.0f} GB/s; a device copy of as many bytes takes "
        f"{copy_s * 1e3:.2f} ms = {moved / copy_s / 1e9:.0f} GB/s: "
        f"**{copy_s / fwd_s:.0%} of copy bandwidth**",
        flush=True,
    )
    print(f"\n## GRU 1 -> {args.hidden}, T = {args.gru_length}, float32, tol 1e-5\n")
    print(
        "| solver | iterations | max abs err | fwd (ms) | fwd speed-up | grad (ms) "
        "| grad speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, it, err, f, fs, g, gs in gru_rows(args):
        print(
            f"| {name} | {it} | {err:.1e} | {f * 1e3:.2f} | {fs:.1f}x | "
            f"{g * 1e3:.2f} | {gs:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
