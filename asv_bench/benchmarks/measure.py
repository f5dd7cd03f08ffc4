"""How every benchmark measures: compile outside the timing, time the compiled call
with `block_until_ready`, interleave candidates so machine noise hits all alike, and
take peak memory in a fresh process."""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax

SMOKE = os.environ.get("PSCAN_ASV_SMOKE", "") not in ("", "0")


def sizes(full, smoke):
    """asv parameter values: `smoke` when `PSCAN_ASV_SMOKE` is set (CI)."""
    return smoke if SMOKE else full


def compile_timed(fn, *args):
    """`(compiled, seconds)`: `jax.jit(fn)` lowered and compiled for `args`, then run
    once so that timings see neither tracing nor first-call allocation."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    return compiled, seconds


def run(compiled, *args):
    """One call, finished."""
    jax.block_until_ready(compiled(*args))


def temp_mib(compiled) -> float:
    """XLA's temporary-buffer size of a compiled program, MiB."""
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def compile_all(programs, *args, log=False):
    """`{name: (compiled, compile_seconds)}` for a dict of programs on the same args;
    with `log`, each compile is reported on stderr as it ends (on an accelerator one
    program can take minutes or run out of memory)."""
    out = {}
    for name, fn in programs.items():
        if log:
            print(f"compiling {name} ...", end=" ", file=sys.stderr, flush=True)
        out[name] = compile_timed(fn, *args)
        if log:
            print(f"{out[name][1]:.1f} s", file=sys.stderr, flush=True)
    return out


def interleaved_medians(compiled, *args, repeats):
    """Median run time of each compiled program, timed in interleaved rounds."""
    times = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, (exe, _) in compiled.items():
            start = time.perf_counter()
            run(exe, *args)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def report_peak_rss(fn, *args):
    """In a child process: compiles and runs `fn` once, resets the kernel's high-water
    mark (Linux `clear_refs`), runs it again and prints the peak RSS of that run as
    JSON, inputs and outputs included, the compiler's own memory excluded."""
    exe, _ = compile_timed(fn, *args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    run(exe, *args)
    print(json.dumps({"peak_rss_mib": _status_mib("VmHWM")}))


TABLES = str(pathlib.Path(__file__).parent.parent / "tables.py")


def peak_rss_of(script, *argv):
    """Runs `python script *argv` (which ends in `report_peak_rss`); returns MiB."""
    out = subprocess.run(
        [sys.executable, script, *argv], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def table_row(row):
    """One markdown table row, printed at once (tables that take long stream rows)."""
    print("| " + " | ".join(str(x) for x in row) + " |", flush=True)


def print_table(header, rows):
    """A markdown table: the header, its rule, the rows."""
    table_row(header)
    print("|" + "---|" * len(header))
    for row in rows:
        table_row(row)
