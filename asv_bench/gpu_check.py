"""The GPU check: one script, a few minutes on one accelerator, one table.

    python asv_bench/gpu_check.py                    # T = 524288, batch 16, d = 32
    python asv_bench/gpu_check.py --length 4096      # a quick run (any backend)

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

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import pscan
from benchmarks.linear import scan_baseline as scan_linear  # asv_bench/benchmarks


def timed(fn, *args, repeats):
    """`(median seconds, compile seconds)` of `jax.jit(fn)` on `args`."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), compile_s


def linear_rows(args):
    shape = (args.length, args.batch, args.hidden)
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.uniform(ka, shape, minval=0.5, maxval=0.99)
    b = jax.random.normal(kb, shape)
    programs = {"lax.scan": scan_linear}
    for method in ("auto", "sequential", "chunked", "associative"):
        programs[method] = lambda a, b, m=method: pscan.linear_recurrence(a, b, method=m)
    rows, base = [], {}
    for name, f in programs.items():
        grad = jax.grad(lambda a, b, f=f: jnp.sum(f(a, b) ** 2), argnums=(0, 1))
        fwd_s, fwd_c = timed(f, a, b, repeats=args.repeats)
        grad_s, grad_c = timed(grad, a, b, repeats=args.repeats)
        if name == "lax.scan":
            base = {"fwd": fwd_s, "grad": grad_s}
        rows.append((name, fwd_s, base["fwd"] / fwd_s, fwd_c, grad_s,
                     base["grad"] / grad_s, grad_c))
    return rows, a, b


def bandwidth_row(args, a, b):
    chunked = lambda a, b: pscan.linear_recurrence(a, b, method="chunked")
    fwd_s, _ = timed(chunked, a, b, repeats=args.repeats)
    moved = a.nbytes + b.nbytes + b.nbytes  # read a, b; write hs
    # a copy reads and writes its array: copying moved / 2 bytes moves as many
    x = jnp.zeros(moved // 2 // 4, jnp.float32)
    copy_s, _ = timed(lambda x: x + 1, x, repeats=args.repeats)
    return moved, fwd_s, copy_s


def gru_rows(args):
    length = args.gru_length
    cell = eqx.nn.GRUCell(1, args.hidden, key=jax.random.PRNGKey(0))
    xs = jax.random.normal(jax.random.PRNGKey(1), (length, 1))
    h0 = jnp.zeros(args.hidden)
    tol = dict(rtol=1e-5, atol=1e-5)
    solvers = {
        "Sequential (lax.scan)": pscan.Sequential(),
        f"Newton(chunk_size={args.chunk})": pscan.Newton(chunk_size=args.chunk, **tol),
        f"Picard(chunk_size={args.chunk})": pscan.Picard(chunk_size=args.chunk, **tol),
    }
    rows, base = [], {}
    for name, solver in solvers.items():
        solve = lambda c, xs, s=solver: pscan.recurrence(c, xs, h0, solver=s, throw=False)
        iters = int(jax.jit(solve)(cell, xs).stats["num_iterations"])
        err = float(jnp.max(jnp.abs(
            jax.jit(solve)(cell, xs).hs
            - pscan.recurrence(cell, xs, h0).hs
        )))
        grad_fn = eqx.filter_grad(lambda c, xs, s=solve: jnp.sum(s(c, xs).hs))
        fwd_s, _ = timed(lambda c, xs, s=solve: s(c, xs).hs, cell, xs,
                         repeats=args.repeats)
        grad_s, _ = timed(lambda c, xs: grad_fn(c, xs), cell, xs, repeats=args.repeats)
        if not base:
            base = {"fwd": fwd_s, "grad": grad_s}
        rows.append((name, iters, err, fwd_s, base["fwd"] / fwd_s, grad_s,
                     base["grad"] / grad_s))
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
    print(f"# pscan GPU check, {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, "
          f"{device.platform} {device.device_kind}")
    rows, a, b = linear_rows(args)
    print(f"\n## Linear recurrence, T = {args.length}, batch {args.batch}, "
          f"d = {args.hidden}, float32 (speed-up = lax.scan time / method time)\n")
    print("| method | fwd (ms) | fwd speed-up | fwd compile (s) | grad (ms) "
          "| grad speed-up | grad compile (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, f, fs, fc, g, gs, gc in rows:
        print(f"| {name} | {f * 1e3:.2f} | {fs:.1f}x | {fc:.2f} | {g * 1e3:.2f} | "
              f"{gs:.1f}x | {gc:.2f} |", flush=True)
    moved, fwd_s, copy_s = bandwidth_row(args, a, b)
    print(f"\n## Bandwidth of the chunked forward\n\n"
          f"moves {moved / 2**20:.0f} MiB in {fwd_s * 1e3:.2f} ms = "
          f"{moved / fwd_s / 1e9:.0f} GB/s; a device copy of as many bytes takes "
          f"{copy_s * 1e3:.2f} ms = {moved / copy_s / 1e9:.0f} GB/s: "
          f"**{copy_s / fwd_s:.0%} of copy bandwidth**", flush=True)
    print(f"\n## GRU 1 -> {args.hidden}, T = {args.gru_length}, float32, tol 1e-5\n")
    print("| solver | iterations | max abs err | fwd (ms) | fwd speed-up | grad (ms) "
          "| grad speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, it, err, f, fs, g, gs in gru_rows(args):
        print(f"| {name} | {it} | {err:.1e} | {f * 1e3:.2f} | {fs:.1f}x | "
              f"{g * 1e3:.2f} | {gs:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
