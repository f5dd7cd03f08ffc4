"""The benchmark tables in one run: pscan against plain `lax.scan`, ratios measured in
the same run (this is what docs/benchmarks.md quotes).

    python asv_bench/tables.py linear     # linear recurrence, T = 524288, d = 32
    python asv_bench/tables.py solvers    # GRU 1 -> 32, T = 65536, every solver
    python asv_bench/tables.py deer       # Newton(chunk_size=1) vs reference DEER per iteration
    python asv_bench/tables.py chaos      # iterations on chaotic AR-GRUs vs reference DEER
    python asv_bench/tables.py gradmem    # gradient memory of the solvers vs lax.scan
    python asv_bench/tables.py seed       # Elman 32 -> 32, batch 16, T = 524288, gradient
    python asv_bench/tables.py sharding   # sharded linear recurrence on 1, 2, 4 host devices
    python asv_bench/tables.py warmstart  # iterations saved by recurrence(guess=) in training
    python asv_bench/tables.py packed     # 16 series of different lengths: resets vs padding
    python asv_bench/tables.py compile    # gradient compile time of every solver
    python asv_bench/tables.py precision  # Jacobians at full or default precision
    python asv_bench/tables.py eager      # calls outside jit, as in a notebook

Every candidate is compiled first (compile time reported), then the compiled programs are
timed in interleaved rounds so that machine noise hits all candidates alike (median
reported). Memory: XLA's temp-buffer figure of the compiled program, and (where
printed) the peak RSS of a fresh process that runs one candidate once. The scenarios are
those of the asv suite (`benchmarks/scenarios.py`).
"""

import argparse
import dataclasses
import importlib.metadata
import os
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from benchmarks.measure import (
    compile_all,
    interleaved_medians,
    peak_rss_of,
    print_table,
    report_peak_rss,
    table_row,
    temp_mib,
)
from benchmarks.scenarios import (
    AR_GRU_CONFIGS,
    MILD_AR_GRU_CONFIG,
    ar_gru_problem,
    cell_residual,
    chaos_solvers,
    deer_reference,
    elman_problem,
    gru_problem,
    gru_solvers,
    linear_problem,
    linear_programs,
    packed_problem,
    packed_programs,
    seed_programs,
    solver_programs,
)

import pscan
import pscan.nn


def _child_args(args, *names):
    out = [args.what]
    for name in names:
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def linear(args):
    a, b = linear_problem(args.length, args.state, dtype=args.dtype)
    names = ["lax.scan", *args.methods.split(",")]
    if args.child:
        name, program = args.child.split("/")
        return report_peak_rss(linear_programs(name)[program], a, b)
    programs = {(n, p): f for n in names for p, f in linear_programs(n).items()}
    compiled = compile_all(programs, a, b)
    med = interleaved_medians(compiled, a, b, repeats=args.repeats)
    print(
        f"# linear recurrence T={args.length} d={args.state} {args.dtype}, "
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"median of {args.repeats} interleaved runs"
    )
    header = ["method", "program", "time (ms)", "vs lax.scan", "compile (s)"]
    header += ["XLA temp (MiB)"]
    if not args.no_memory:
        header += ["peak RSS (MiB)", "RSS vs lax.scan"]
    rows, rss = [], {}
    for (name, program), (exe, compile_s) in compiled.items():
        t, base = med[name, program], med["lax.scan", program]
        row = [name, program, f"{t * 1e3:.1f}", f"{t / base:.2f}x", f"{compile_s:.2f}"]
        row.append(f"{temp_mib(exe):.0f}")
        if not args.no_memory:
            child = _child_args(args, "length", "state", "dtype", "methods")
            rss[name, program] = peak_rss_of(
                __file__, *child, "--child", f"{name}/{program}"
            )
            ratio = rss[name, program] / rss["lax.scan", program]
            row += [f"{rss[name, program]:.0f}", f"{ratio:.2f}x"]
        rows.append(row)
    print_table(header, rows)


def _without(candidates, skip):
    """`candidates` less those whose name contains a fragment of the comma-separated
    `skip`."""
    fragments = [s for s in skip.split(",") if s]
    return {n: c for n, c in candidates.items() if not any(f in n for f in fragments)}


def solvers(args):
    candidates = _without(gru_solvers(chunk=args.chunk, tol=args.tol), args.skip)
    cell, xs, h0 = gru_problem(args.length, args.hidden)
    reference = jax.jit(solver_programs(candidates["Sequential"], h0)["fwd"])(cell, xs)
    programs, iterations = {}, {}
    for name, solver in candidates.items():
        p = solver_programs(solver, h0)
        sol = jax.jit(p["solve"])(cell, xs)
        err = float(jnp.max(jnp.abs(sol.hs - reference)))
        iterations[name] = (int(sol.stats["num_iterations"]), err)
        programs[name, "fwd"], programs[name, "grad"] = p["fwd"], p["grad"]
    compiled = compile_all(programs, cell, xs)
    med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
    d, t = args.hidden, args.length
    print(
        f"# GRU 1 -> {d}, T = {t}, float32, tol {args.tol}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}, median of {args.repeats} interleaved runs"
    )
    header = ["solver", "iterations", "max abs err vs Sequential", "fwd (ms)"]
    header += ["fwd vs Sequential", "grad (ms)", "grad vs Sequential", "grad / fwd"]
    header += ["XLA temp fwd (MiB)", "XLA temp grad (MiB)"]
    header += ["grad compile (s)", "compile vs Sequential"]
    base_f, base_g = med["Sequential", "fwd"], med["Sequential", "grad"]
    base_c = compiled["Sequential", "grad"][1]
    rows = []
    for name, (iters, err) in iterations.items():
        f, g = med[name, "fwd"], med[name, "grad"]
        rows.append(
            [
                name,
                iters,
                f"{err:.1e}",
                f"{f * 1e3:.0f}",
                f"{f / base_f:.2f}x",
                f"{g * 1e3:.0f}",
                f"{g / base_g:.2f}x",
                f"{g / f:.2f}",
                f"{temp_mib(compiled[name, 'fwd'][0]):.0f}",
                f"{temp_mib(compiled[name, 'grad'][0]):.0f}",
                f"{compiled[name, 'grad'][1]:.1f}",
                f"{compiled[name, 'grad'][1] / base_c:.2f}x",
            ]
        )
    print_table(header, rows)


def deer(args):
    """`Newton(chunk_size=1)` (DEER mode) against DEER as its authors run it, for a
    fixed number of iterations: time and XLA temp per forward."""
    cell, xs, h0 = gru_problem(args.length, args.hidden)
    n = args.iterations
    newton = pscan.Newton(max_iters=n, rtol=0.0, atol=0.0)
    programs = {
        "reference DEER (seq1d)": lambda c, xs: deer_reference(c, xs, h0, n),
        "pscan Newton(chunk_size=1)": lambda c, xs: (
            pscan.recurrence(c, xs, h0, solver=newton, throw=False).hs
        ),
    }
    ref = jax.jit(programs["reference DEER (seq1d)"])(cell, xs)
    out = jax.jit(programs["pscan Newton(chunk_size=1)"])(cell, xs)
    print(
        f"# GRU 1 -> {args.hidden}, T = {args.length}, {n} iterations each, float32, "
        f"jax {jax.__version__}, backend {jax.default_backend()}; max |difference| "
        f"{float(jnp.max(jnp.abs(ref - out))):.1e}"
    )
    compiled = compile_all(programs, cell, xs)
    med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
    base = "reference DEER (seq1d)"
    header = [
        "",
        "per iteration (ms)",
        "vs reference",
        "XLA temp (MiB)",
        "vs reference",
    ]
    rows = []
    for name, (exe, _) in compiled.items():
        rows.append(
            [
                name,
                f"{med[name] / n * 1e3:.0f}",
                f"{med[name] / med[base]:.2f}x",
                f"{temp_mib(exe):.0f}",
                f"{temp_mib(exe) / temp_mib(compiled[base][0]):.2f}x",
            ]
        )
    print_table(header, rows)


def chaos(args):
    """Iterations to converge on chaotic autoregressive GRUs (float32), and on a milder
    one, every solver stopping when no state moved by more than `atol` (pscan:
    `rtol=0`); wall time of one compiled solve; ELK's final trust radius; in how many
    iterations an iterate ran away to the float bound (pscan's solvers)."""
    cells = {"1": AR_GRU_CONFIGS[0], "2": AR_GRU_CONFIGS[1], "mild": MILD_AR_GRU_CONFIG}
    chosen = args.cells.split(",")
    if not set(chosen) <= set(cells):
        raise SystemExit(
            f"--cells: a comma-separated list of {list(cells)}, got {chosen}"
        )
    solvers = _without(chaos_solvers(args.length, args.atol), args.skip)
    print(f"# T = {args.length}, float32, atol {args.atol}, jax {jax.__version__}")
    header = ["cell (d, gain, readout gain)", "solver", "converged", "iterations"]
    header += ["max residual |h[t] - cell(x[t], h[t-1])|", "wall time (s)"]
    header += ["final radius", "iterations at the float bound"]
    print_table(header, [])
    for name in chosen:
        _chaos_rows(args, solvers, cells[name])


def _timed(fn, *args):
    """`(output, seconds)` of a compiled call (compiled by a first call)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def _chaos_rows(args, solvers, config):
    cell, xs, h0 = ar_gru_problem(args.length, *config)
    name = f"AR-GRU {config[:3]}"
    residual = lambda hs: f"{cell_residual(cell, xs, h0, hs):.1e}"
    run = lambda c, xs: deer_reference(c, xs, h0, args.length + 1, args.atol)
    (hs, it), seconds = _timed(jax.jit(run), cell, xs)
    converged = int(it) <= args.length
    label = "reference DEER (seq1d)"
    row = [name, label, converged, int(it), residual(hs), f"{seconds:.2f}", "", ""]
    table_row(row)
    for label, solver in solvers.items():
        solve = eqx.filter_jit(
            lambda c, xs, s=solver: pscan.recurrence(c, xs, h0, solver=s, throw=False)
        )
        sol, seconds = _timed(solve, cell, xs)
        ok = bool(sol.result == pscan.RESULTS.successful)
        radius = sol.stats.get("radius")
        radius = "" if radius is None else f"{float(radius):.0e}"
        iters = int(sol.stats["num_iterations"])
        row = [name, label, ok, iters, residual(sol.hs), f"{seconds:.2f}", radius]
        table_row([*row, int(sol.stats["num_at_bound"])])


def gradmem(args):
    """XLA temp of each solver's gradient against `Sequential()`'s (autodiff through
    `lax.scan`), compiled only, as a user runs it (`throw=True`): GRU 1 -> d,
    gradients of `sum(hs)` and of `sum(hs**2)` (whose backward pass needs the states)
    wrt the cell."""
    chunk, tol = args.chunk, dict(rtol=args.tol, atol=args.tol)
    candidates = {
        "Sequential": pscan.Sequential(),
        f"Newton(chunk_size={chunk})": pscan.Newton(chunk_size=chunk, **tol),
        f"Picard(chunk_size={chunk})": pscan.Picard(chunk_size=chunk, **tol),
        f"Newton(chunk_size={chunk}, diagonal)": pscan.Newton(
            chunk_size=chunk, jacobian="diagonal", **tol
        ),
        "Newton(diagonal) = quasi-DEER": pscan.Newton(jacobian="diagonal", **tol),
        f"ELK(chunk_size={chunk})": pscan.ELK(chunk_size=chunk, **tol),
    }
    print(f"# GRU, float32, jax {jax.__version__}, backend {jax.default_backend()}")
    header = ["T", "d", "solver", "XLA temp fwd (MiB)", "XLA temp grad (MiB)"]
    header += ["grad vs Sequential", "grad of sum(hs**2) (MiB)", "vs Sequential"]
    print_table(header, [])
    for size in args.sizes.split(","):
        length, hidden = (int(n) for n in size.split("x"))
        cell, xs, h0 = gru_problem(length, hidden)
        base = None
        for name, solver in candidates.items():
            p = solver_programs(solver, h0)
            fwd, grad, grad_sq = (
                temp_mib(jax.jit(p[k]).lower(cell, xs).compile())
                for k in ("fwd", "grad", "grad_sq")
            )
            base = (grad, grad_sq) if base is None else base
            table_row(
                [
                    length,
                    hidden,
                    name,
                    f"{fwd:.1f}",
                    f"{grad:.1f}",
                    f"{grad / base[0]:.2f}x",
                    f"{grad_sq:.1f}",
                    f"{grad_sq / base[1]:.2f}x",
                ]
            )


def seed(args):
    cell, xs = elman_problem(args.length, args.batch, args.hidden)
    programs = seed_programs(every=args.every)
    if args.child:
        return report_peak_rss(programs[args.child], cell, xs)
    compiled = compile_all(programs, cell, xs)
    med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
    child = _child_args(args, "length", "batch", "hidden", "every")
    rss = {name: peak_rss_of(__file__, *child, "--child", name) for name in programs}
    print(
        f"# Elman {args.hidden} -> {args.hidden}, batch {args.batch}, T = {args.length}, "
        f"gradient of sum(hs), jax {jax.__version__}, median of {args.repeats}"
    )
    header = ["program", "grad (s)", "vs lax.scan", "peak RSS (MiB)", "vs lax.scan"]
    header += ["XLA temp (MiB)"]
    base_t, base_m = med["lax.scan"], rss["lax.scan"]
    print_table(
        header,
        [
            [
                name,
                f"{med[name]:.2f}",
                f"{med[name] / base_t:.2f}x",
                f"{rss[name]:.0f}",
                f"{rss[name] / base_m:.2f}x",
                f"{temp_mib(compiled[name][0]):.0f}",
            ]
            for name in programs
        ],
    )


def packed(args):
    """A batch of series of different lengths three ways (`scenarios.packed_programs`),
    for an exact and a parallel solver: time, XLA temp and iterations, each way
    against the packed one; and the same steps without resets (what resets cost)."""
    cell, xs, h0, lengths = packed_problem(args.length, args.count, args.hidden)
    tol = dict(rtol=args.tol, atol=args.tol)
    candidates = {
        "Sequential()": pscan.Sequential(),
        f"Newton(chunk_size={args.chunk})": pscan.Newton(chunk_size=args.chunk, **tol),
    }
    print(
        f"# GRU 1 -> {args.hidden}, {args.count} series of {min(lengths)} to "
        f"{max(lengths)} steps, {sum(lengths)} in all, float32, tol {args.tol}, "
        f"throw=True (the default), jax "
        f"{jax.__version__}, backend {jax.default_backend()}, median of "
        f"{args.repeats} interleaved runs"
    )
    header = ["solver", "way", "iterations", "max abs err", "fwd (ms)", "fwd vs packed"]
    header += ["grad (ms)", "grad vs packed", "XLA temp fwd (MiB)"]
    header += ["XLA temp grad (MiB)", "grad temp vs packed"]
    table_row(header)
    print("|" + "---|" * len(header))
    reference = None
    for name, solver in candidates.items():
        ways = packed_programs(solver, h0, lengths)
        programs, solved = {}, {}
        for way, p in ways.items():
            sol = jax.jit(p["solve"])(cell, xs)
            if reference is None:
                reference = sol.hs
            err = float(jnp.max(jnp.abs(sol.hs - reference)))
            solved[way] = (int(sol.stats["num_iterations"]), err)
            programs[way, "fwd"], programs[way, "grad"] = p["fwd"], p["grad"]
        # what the resets cost: the same steps as one series (another answer, so no
        # error column), timed with the three ways
        plain = "same steps, no resets"
        whole = solver_programs(solver, h0)  # the default throw=True, as the ways
        solved[plain] = (
            int(jax.jit(whole["solve"])(cell, xs).stats["num_iterations"]),
            None,
        )
        programs[plain, "fwd"], programs[plain, "grad"] = whole["fwd"], whole["grad"]
        compiled = compile_all(programs, cell, xs)
        med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
        first = next(iter(ways))
        temp = {key: temp_mib(exe) for key, (exe, _) in compiled.items()}
        for way, (iters, err) in solved.items():
            f, g = med[way, "fwd"], med[way, "grad"]
            table_row(
                [
                    name,
                    way,
                    iters,
                    "" if err is None else f"{err:.1e}",
                    f"{f * 1e3:.0f}",
                    f"{f / med[first, 'fwd']:.2f}x",
                    f"{g * 1e3:.0f}",
                    f"{g / med[first, 'grad']:.2f}x",
                    f"{temp[way, 'fwd']:.0f}",
                    f"{temp[way, 'grad']:.0f}",
                    f"{temp[way, 'grad'] / temp[first, 'grad']:.2f}x",
                ]
            )


def _solve_from(solver, h0, warm):
    """`solve(cell, xs, previous)`, starting from `previous` if `warm`."""
    return lambda c, xs, previous: pscan.recurrence(
        c, xs, h0, solver=solver, guess=previous if warm else None, throw=False
    )


def warmstart(args):
    """A training loop's view: after an optimiser-sized change of the cell, solve again
    from scratch or from the last step's states (`guess=`)."""
    cell, xs, h0 = gru_problem(args.length, args.hidden)
    previous = jax.jit(solver_programs(gru_solvers()["Sequential"], h0)["fwd"])(
        cell, xs
    )
    key = jax.random.PRNGKey(2)

    def nudge(x):  # a relative change of `--step` in every parameter
        noise = jax.random.normal(key, x.shape, x.dtype)
        return x * (1 + args.step * noise)

    moved = jax.tree_util.tree_map(
        lambda x: nudge(x) if eqx.is_inexact_array(x) else x, cell
    )
    candidates = {
        k: v
        for k, v in gru_solvers(chunk=args.chunk, tol=args.tol).items()
        if k.startswith(("Picard", "Newton")) and "diagonal)" not in k
    }
    programs, iterations = {}, {}
    for name, solver in candidates.items():
        for how in ("cold", "warm"):
            solve = _solve_from(solver, h0, how == "warm")
            sol = jax.jit(solve)(moved, xs, previous)
            iterations[name, how] = int(sol.stats["num_iterations"])
            programs[name, how] = lambda c, xs, g, f=solve: f(c, xs, g).hs
    compiled = compile_all(programs, moved, xs, previous)
    med = interleaved_medians(compiled, moved, xs, previous, repeats=args.repeats)
    print(
        f"# warm start: GRU 1 -> {args.hidden}, T = {args.length}, parameters moved by "
        f"{args.step:g} (relative), tol {args.tol}, jax {jax.__version__}, backend "
        f"{jax.default_backend()}, median of {args.repeats}"
    )
    header = ["solver", "iterations cold", "iterations warm", "fwd cold (ms)"]
    header += ["fwd warm (ms)", "warm / cold"]
    rows = []
    for name in candidates:
        cold, warm = med[name, "cold"], med[name, "warm"]
        rows.append(
            [
                name,
                iterations[name, "cold"],
                iterations[name, "warm"],
                f"{cold * 1e3:.0f}",
                f"{warm * 1e3:.0f}",
                f"{warm / cold:.2f}x",
            ]
        )
    print_table(header, rows)


def sharding(args):
    """Each device count in its own process: the forced host device count is read
    when JAX starts. On a CPU the "devices" share the machine's cores."""
    if args.child:
        return _sharding_child(args)
    rows = []
    for n in [int(x) for x in args.devices.split(",")]:
        child = _child_args(args, "length", "channels", "repeats")
        out = subprocess.run(
            [sys.executable, __file__, *child, "--child", str(n)],
            capture_output=True,
            text=True,
            check=True,
            env={
                **os.environ,
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
            },
        )
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1]
        _, _, fwd, grad, *plain = line.split()
        if plain:
            rows.append(("plain linear_recurrence", *map(float, plain)))
        rows.append((n, float(fwd), float(grad)))
    print(
        f"# sharded_linear_recurrence, T = {args.length}, d = {args.channels}, "
        f"float32, forced host devices, median of {args.repeats}"
    )
    print_table(
        ["devices", "fwd (ms)", "fwd vs plain", "grad (ms)", "grad vs plain"],
        [
            [
                n,
                f"{f * 1e3:.1f}",
                f"{rows[0][1] / f:.2f}x",
                f"{g * 1e3:.1f}",
                f"{rows[0][2] / g:.2f}x",
            ]
            for n, f, g in rows
        ],
    )
    print(
        "(`vs plain`: the single-device `pscan.linear_recurrence` time over this one)"
    )


def _sharding_child(args):
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import pscan

    devices = int(args.child)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("time",))
    a, b = linear_problem(args.length, args.channels)
    # the inputs already live split over the devices, as they would in a real job
    split = NamedSharding(mesh, PartitionSpec("time"))
    a, b = jax.device_put(a, split), jax.device_put(b, split)
    f = lambda a, b: pscan.sharded_linear_recurrence(a, b, mesh=mesh, axis_name="time")
    programs = {
        "fwd": f,
        "grad": jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1)),
    }
    if devices == 1:  # the single-device reference
        programs.update({"plain " + k: v for k, v in linear_programs("auto").items()})
    med = interleaved_medians(compile_all(programs, a, b), a, b, repeats=args.repeats)
    plain = f"{med['plain fwd']} {med['plain grad']}" if devices == 1 else ""
    print(f"RESULT {devices} {med['fwd']} {med['grad']} {plain}")


def _fastest_compile(fn, args, repeats, device=None):
    """Fastest of `repeats` fresh traces, lowerings and compiles of `jit(fn)(*args)`
    (`jax.clear_caches()` before each), seconds; for `device` (of an ahead-of-time
    topology), the arrays given as shapes placed there."""
    arrays, rest = eqx.partition(args, eqx.is_array)
    if device is not None:
        arrays = jax.tree_util.tree_map(lambda x: _placed(x, device), arrays)
    best = float("inf")
    for _ in range(repeats):
        jax.clear_caches()
        start = time.perf_counter()
        jax.jit(lambda a: fn(*eqx.combine(a, rest))).trace(arrays).lower().compile()
        best = min(best, time.perf_counter() - start)
    return best


def _placed(x, device):
    """The shape and dtype of `x`, placed on `device` (to compile for it)."""
    place = jax.sharding.SingleDeviceSharding(device)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place)


def _aot_device(topology):
    """The first device of a TPU `topology` (e.g. `"v5e:2x2"`) to compile for ahead of
    time on this host (libtpu installed, no TPU needed), with pscan's TPU code paths
    traced: `jax.default_backend()` reports "tpu" from here on."""
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology, "tpu").devices[0]
    jax.default_backend = lambda: "tpu"
    # the compiler's one-time start-up, outside the timings
    one = _placed(jnp.zeros(8, jnp.float32), device)
    jax.jit(lambda x: x + 1).trace(one).lower().compile()
    return device


def compile_times(args):
    """Gradient compile time, fastest of `--repeats` fresh compiles: every solver on
    the bare GRU of `solvers`, and the loss of `examples/train_long_series.py`
    (`--model gru`, two layers) with the example's own `--solver` choices, and
    Picard, diagonal Newton and ELK at Newton's settings."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import train_long_series as example

    n, t = args.repeats, args.length
    device = None if args.aot is None else _aot_device(args.aot)
    backend = jax.default_backend()
    if device is not None:
        libtpu = importlib.metadata.version("libtpu")
        backend += (
            f" (compiled ahead of time for {args.aot}, {device.device_kind}, "
            f"libtpu {libtpu})"
        )
    print(f"# T = {t}, jax {jax.__version__}, backend {backend}, fastest of {n}")
    cell, xs, h0 = gru_problem(t, args.hidden)
    bare = {
        name: (solver_programs(solver, h0)["grad"], (cell, xs))
        for name, solver in gru_solvers(chunk=args.chunk).items()
    }
    series = jnp.asarray(example.mackey_glass(t + 20))
    mask = jnp.ones(t, bool)
    grad = eqx.filter_value_and_grad(example.make_loss(20))
    newton = example.SOLVERS["newton"]
    layers = dict(example.SOLVERS)
    same = dict(
        chunk_size=newton.chunk_size,
        rtol=newton.rtol,
        atol=newton.atol,
        max_iters=newton.max_iters,
    )
    layers["picard"] = pscan.Picard(**same)
    layers["newton, diagonal"] = pscan.Newton(jacobian="diagonal", **same)
    layers["elk"] = pscan.ELK(**same)
    model = lambda s: example.Forecaster(
        "gru", args.hidden, 2, s, key=jax.random.PRNGKey(0)
    )
    whole = {
        f"--solver {name}": (grad, (model(solver), series, mask))
        for name, solver in layers.items()
    }
    programs = {
        f"GRU 1 -> {args.hidden} (vs Sequential)": bare,
        "train_long_series --model gru (vs --solver sequential)": whole,
    }
    rows = []
    for program, candidates in programs.items():
        seconds = {k: _fastest_compile(*c, n, device) for k, c in candidates.items()}
        base = seconds[
            "Sequential" if "Sequential" in seconds else "--solver sequential"
        ]
        for name, value in seconds.items():
            rows.append([program, name, f"{value:.2f}", f"{value / base:.2f}x"])
    print_table(["program", "solver", "grad compile (s)", "vs sequential"], rows)


def precision(args):
    """Jacobians at full precision (one forward-mode pass with the chunk ends) against
    `jacobian_precision="default"` (the ends apart at full precision): iterations and
    errors on the chaotic AR-GRUs, then time and compile time on the GRU. On CPU every
    product is exact whatever its precision: the separate pass is forced there, and
    the rows differ only by its cost."""
    pscan._precision._products_exact = lambda: False
    variants = ("highest", "default")
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}, float32")
    header = [f"cell (T = {args.length}, atol {args.atol})", "solver"]
    header += ["iterations, Jacobians at highest", "at default"]
    header += ["max error vs Sequential, highest", "at default"]
    print_table(header, [])
    for config in (*AR_GRU_CONFIGS, MILD_AR_GRU_CONFIG):
        cell, xs, h0 = ar_gru_problem(args.length, *config)
        with jax.default_matmul_precision("highest"):
            exact = pscan.recurrence(cell, xs, h0, solver=pscan.Sequential()).hs
        solvers = _without(chaos_solvers(args.length, args.atol), args.skip)
        for label, solver in solvers.items():
            iters, errors = [], []
            for jp in variants:
                s = dataclasses.replace(solver, jacobian_precision=jp)
                solve = eqx.filter_jit(
                    lambda c, xs, h0, s=s: pscan.recurrence(
                        c, xs, h0, solver=s, throw=False
                    )
                )
                sol = solve(cell, xs, h0)
                iters.append(int(sol.stats["num_iterations"]))
                errors.append(f"{float(jnp.max(jnp.abs(sol.hs - exact))):.1e}")
            table_row([f"AR-GRU {config[:3]}", label, *iters, *errors])
    cell, xs, h0 = gru_problem(args.gru_length)
    with jax.default_matmul_precision("highest"):
        exact = jax.jit(
            lambda c, xs: pscan.recurrence(c, xs, h0, solver=pscan.Sequential()).hs
        )(cell, xs)
    tol = dict(rtol=args.atol, atol=args.atol)
    header = [f"GRU 1 -> 32, T = {args.gru_length}", "Jacobians", "max error"]
    header += ["fwd (ms)", "fwd compile (s)", "grad (ms)", "grad compile (s)"]
    print_table(header, [])
    gru = {
        f"Newton(chunk_size={args.chunk})": pscan.Newton(chunk_size=args.chunk, **tol),
        f"ELK(chunk_size={args.chunk})": pscan.ELK(chunk_size=args.chunk, **tol),
        "Newton() = DEER": pscan.Newton(**tol),
    }
    for label, solver in _without(gru, args.skip).items():
        programs = {}
        for jp in variants:
            s = dataclasses.replace(solver, jacobian_precision=jp)
            runs = solver_programs(s, h0)
            programs[jp, "fwd"], programs[jp, "grad"] = runs["fwd"], runs["grad_sq"]
        compiled = compile_all(programs, cell, xs)
        med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
        for jp in variants:
            hs = compiled[jp, "fwd"][0](cell, xs)
            errors = f"{float(jnp.max(jnp.abs(hs - exact))):.1e}"
            times = []
            for kind in ("fwd", "grad"):
                times += [f"{med[jp, kind] * 1e3:.2f}", f"{compiled[jp, kind][1]:.2f}"]
            table_row([label, jp, errors, *times])


def eager(args):
    """Calls outside `jax.jit`, as in a notebook: the first call (tracing and
    compiling included) and the median of later calls with new values of the same
    shapes, against a `lax.scan` of the same cell called the same way."""
    cell, xs, h0 = gru_problem(args.length, args.hidden)
    c = args.chunk
    step = lambda h, x: (cell(x, h), cell(x, h))
    layer = pscan.nn.Recurrence(cell)
    calls = {
        "lax.scan": lambda xs: lax.scan(step, h0, xs)[1],
        "recurrence, Sequential()": lambda xs: pscan.recurrence(cell, xs, h0).hs,
        f"recurrence, Newton(chunk_size={c})": lambda xs: (
            pscan.recurrence(cell, xs, h0, solver=pscan.Newton(chunk_size=c)).hs
        ),
        f"recurrence, ELK(chunk_size={c})": lambda xs: (
            pscan.recurrence(cell, xs, h0, solver=pscan.ELK(chunk_size=c)).hs
        ),
        "nn.Recurrence(GRUCell), default solver": layer,
        "associative_scan(jnp.maximum, chunked)": lambda xs: pscan.associative_scan(
            jnp.maximum, xs, method="chunked"
        ),
    }
    inputs = [xs + 1e-3 * i for i in range(args.repeats + 1)]
    print(
        f"# GRU 1 -> {args.hidden}, T = {args.length}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}, later calls: median of {args.repeats}"
    )

    def seconds(call, x):
        start = time.perf_counter()
        jax.block_until_ready(call(x))
        return time.perf_counter() - start

    first = {name: seconds(call, inputs[0]) for name, call in calls.items()}
    # the later calls in interleaved rounds, as the other tables time theirs
    later = {name: [] for name in calls}
    for x in inputs[1:]:
        for name, call in calls.items():
            later[name].append(seconds(call, x))
    later = {name: statistics.median(ts) for name, ts in later.items()}
    base = later["lax.scan"]
    rows = [
        [name, f"{first[name]:.3f}", f"{1e3 * t:.1f}", f"{t / base:.2f}x"]
        for name, t in later.items()
    ]
    header = ["call", "first call (s)", "later calls (ms)", "later vs lax.scan"]
    print_table(header, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("linear", help="linear_recurrence methods vs lax.scan")
    p.add_argument("--length", type=int, default=524288)
    p.add_argument("--state", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--methods",
        default="auto,sequential,chunked,associative",
        help="comma-separated; `chunked:C` sets the chunk size",
    )
    p.add_argument("--no-memory", action="store_true", help="skip peak-RSS runs")
    p = sub.add_parser("solvers", help="nonlinear solvers on a GRU vs Sequential")
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated name fragments")
    p = sub.add_parser("deer", help="Newton(chunk_size=1) vs reference DEER")
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("chaos", help="iterations on chaotic AR-GRUs vs reference DEER")
    p.add_argument("--length", type=int, default=2000)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--skip", default="", help="comma-separated name fragments")
    p.add_argument(
        "--cells",
        default="1,2,mild",
        help="comma-separated: 1 and 2 (the chaotic AR-GRUs), mild (the milder one)",
    )
    p = sub.add_parser("gradmem", help="gradient memory of the solvers vs lax.scan")
    p.add_argument(
        "--sizes", default="16384x128,524288x32,524287x32", help="TxD,TxD,..."
    )
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--tol", type=float, default=1e-5)
    p = sub.add_parser("seed", help="the seed scenario's gradient vs lax.scan")
    p.add_argument("--length", type=int, default=524288)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--every", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("warmstart", help="iterations saved by a warm start")
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--step", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("packed", help="series of different lengths: resets vs padding")
    p.add_argument("--length", type=int, default=2**19)
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("compile", help="gradient compile time of every solver")
    p.add_argument("--length", type=int, default=100000)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--aot",
        metavar="TOPOLOGY",
        help="compile for a TPU ahead of time on this host, e.g. v5e:2x2 (needs "
        "libtpu: pip install 'jax[tpu]'; no TPU)",
    )
    p = sub.add_parser("precision", help="Jacobians at full vs default precision")
    p.add_argument("--length", type=int, default=500, help="T of the chaotic cells")
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--gru-length", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--skip", default="", help="comma-separated name fragments")
    p = sub.add_parser("eager", help="calls outside jit: first and later calls")
    p.add_argument("--length", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=8)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p = sub.add_parser("sharding", help="sharded linear recurrence on host devices")
    p.add_argument("--length", type=int, default=2**20)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--devices", default="1,2,4")
    p.add_argument("--repeats", type=int, default=5)
    for p in sub.choices.values():
        p.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    commands = {"linear": linear, "solvers": solvers, "seed": seed, "gradmem": gradmem}
    commands.update(warmstart=warmstart, sharding=sharding, deer=deer, chaos=chaos)
    commands.update(packed=packed, compile=compile_times, precision=precision)
    commands.update(eager=eager)
    commands[args.what](args)


if __name__ == "__main__":
    main()
