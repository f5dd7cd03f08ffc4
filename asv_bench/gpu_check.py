"""The GPU check: one script, a few minutes on one accelerator, one table.

    python asv_bench/gpu_check.py                    # T = 524288, batch 16, d = 32
    python asv_bench/gpu_check.py --length 4096 --gru-length 4096   # quick, any backend

Measures, against sequential `lax.scan` on the same device, in one run (the candidates
of `tables.py linear` and `tables.py solvers`, compiled first, then timed in
`--repeats` interleaved rounds, medians; `benchmarks/measure.py`):

1. the linear recurrence `h[t] = a[t] * h[t-1] + b[t]` on (T, batch, d), forward and
   gradient with respect to (a, b), for every method (target on an H200: >= 100x);
2. a GRU cell 1 -> d: chunked `pscan.Newton` and `pscan.Picard` against
   `pscan.Sequential` (a plain `lax.scan`), forward and gradient (target: >= 10x), as
   users run them and also with `throw=False` (the run-time check's cost) and Newton
   at the backend's default matrix precision (`precision=None`); and DEER
   (`pscan.Newton()`, one step per chunk, `O(T d^2)` Jacobians);
3. the achieved bandwidth of the chunked forward: the bytes it must move (read a and b,
   write hs) over its time, against that of a device copy of b (target: >= 50%).

Each compile is logged to stderr as it ends. On a 16 GiB TPU v5e the default batch ran
out of memory at compile time (XLA asked for 16 GiB of temporaries): use `--batch 4`
there; `--methods` leaves methods out (the forward of `associative` at T = 524288 had
not compiled after 5 minutes on that TPU) or sweeps chunk sizes (`chunked:128`);
`--batch 0` runs without a batch axis.
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from benchmarks.measure import (  # asv_bench/benchmarks
    compile_all,
    interleaved_medians,
    print_table,
)
from benchmarks.scenarios import (
    LINEAR_METHODS,
    gru_problem,
    gru_solvers,
    linear_problem,
    linear_programs,
    solver_programs,
)


def linear_table(args):
    """Every method's forward and gradient against `lax.scan`'s, interleaved; then the
    bandwidth of the chunked forward against that of a device copy of `b`."""
    a, b = linear_problem(args.length, args.hidden, batch=args.batch or None)
    programs = {
        (name, kind): fn
        for name in args.methods
        for kind, fn in linear_programs(name).items()
    }
    compiled = compile_all(programs, a, b, log=True)
    med = interleaved_medians(compiled, a, b, repeats=args.repeats)
    print(
        f"\n## Linear recurrence, T = {args.length}, batch {args.batch or 'none'}, "
        f"d = {args.hidden}, float32 (speed-up = lax.scan time / method time)\n"
    )
    header = ["method", "fwd (ms)", "fwd speed-up", "fwd compile (s)", "grad (ms)"]
    header += ["grad speed-up", "grad compile (s)"]
    rows = []
    for name in args.methods:
        row = [name]
        for kind in ("fwd", "grad"):
            t, base = med[name, kind], med["lax.scan", kind]
            row += [f"{t * 1e3:.2f}", f"{base / t:.1f}x"]
            row += [f"{compiled[name, kind][1]:.2f}"]
        rows.append(row)
    print_table(header, rows)

    moved = a.nbytes + b.nbytes + b.nbytes  # read a, b; write hs
    # a copy of `b` reads and writes it, in the same shape and device layout
    copy = compile_all({"copy": lambda x: x + 1}, b, log=True)
    copy_s = interleaved_medians(copy, b, repeats=args.repeats)["copy"]
    chunked = [m for m in args.methods if m.partition(":")[0] == "chunked"]
    if not chunked:
        return
    fwd_s = med[chunked[0], "fwd"]
    fwd_rate, copy_rate = moved / fwd_s, 2 * b.nbytes / copy_s
    print(
        f"\n## Bandwidth of the {chunked[0]} forward\n\n"
        f"moves {moved / 2**20:.0f} MiB in {fwd_s * 1e3:.2f} ms = "
        f"{fwd_rate / 1e9:.0f} GB/s; a device copy of `b` moves "
        f"{2 * b.nbytes / 2**20:.0f} MiB in {copy_s * 1e3:.2f} ms = "
        f"{copy_rate / 1e9:.0f} GB/s: **{fwd_rate / copy_rate:.0%} of copy bandwidth**",
        flush=True,
    )


def gru_table(args):
    """Chunked Newton and Picard against `Sequential` (a plain `lax.scan`), as users
    run them (`throw=True`, Newton at its default `precision="highest"`), and without
    the run-time check (`throw=False`: on a TPU it cost ~2.3 ms a call) or at the
    backend's default matrix precision (`precision=None`); chunked Newton with a
    diagonal Jacobian (its gradient's preconditioner at the default precision); and
    DEER and quasi-DEER, whose Jacobians are built in groups of columns (on a TPU
    their loops were most of their iterations)."""
    cell, xs, h0 = gru_problem(args.gru_length, args.hidden)
    every = gru_solvers(chunk=args.chunk)
    newton, picard = (
        f"Newton(chunk_size={args.chunk})",
        f"Picard(chunk_size={args.chunk})",
    )
    candidates = {
        "Sequential": (every["Sequential"], True),
        newton: (every[newton], True),
        picard: (every[picard], True),
        f"{newton[:-1]}, diagonal)": (every[f"{newton[:-1]}, diagonal)"], True),
        f"{newton}, throw=False": (every[newton], False),
        f"{picard}, throw=False": (every[picard], False),
        f"{newton[:-1]}, precision=None)": (
            dataclasses.replace(every[newton], precision=None),
            True,
        ),
        "Newton() = DEER": (every["Newton() = DEER"], True),
        "Newton(diagonal) = quasi-DEER": (every["Newton(diagonal) = quasi-DEER"], True),
    }
    reference = jax.jit(solver_programs(every["Sequential"], h0)["fwd"])(cell, xs)
    programs, solved = {}, {}
    for name, (solver, throw) in candidates.items():
        p = solver_programs(solver, h0, throw=throw)
        sol = jax.jit(p["solve"])(cell, xs)
        err = float(jnp.max(jnp.abs(sol.hs - reference)))
        solved[name] = (int(sol.stats["num_iterations"]), err)
        programs[name, "fwd"], programs[name, "grad"] = p["fwd"], p["grad"]
    compiled = compile_all(programs, cell, xs, log=True)
    med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
    print(f"\n## GRU 1 -> {args.hidden}, T = {args.gru_length}, float32, tol 1e-5\n")
    header = ["solver", "iterations", "max abs err", "fwd (ms)", "fwd speed-up"]
    header += ["grad (ms)", "grad speed-up"]
    rows = []
    for name, (iters, err) in solved.items():
        row = [name, iters, f"{err:.1e}"]
        for kind in ("fwd", "grad"):
            t, base = med[name, kind], med["Sequential", kind]
            row += [f"{t * 1e3:.2f}", f"{base / t:.1f}x"]
        rows.append(row)
    print_table(header, rows)


def _method(name):
    method, _, chunk = name.partition(":")
    if name in LINEAR_METHODS or (method == "chunked" and chunk.isdigit()):
        return name
    raise argparse.ArgumentTypeError(
        f"{name!r}: not one of {LINEAR_METHODS} or chunked:C"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=524288)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--gru-length", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--methods",
        nargs="+",
        type=_method,
        default=list(LINEAR_METHODS),
        help=f"of {LINEAR_METHODS}, or chunked:C for a chunk size C",
    )
    args = parser.parse_args()

    device = jax.devices()[0]
    print(
        f"# pscan GPU check, {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, "
        f"{device.platform} {device.device_kind}, median of {args.repeats} "
        "interleaved runs"
    )
    linear_table(args)
    gru_table(args)


if __name__ == "__main__":
    main()
