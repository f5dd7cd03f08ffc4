"""Measurement helpers shared by the benchmark scripts."""

import json
import statistics
import subprocess
import sys
import time

import jax


def compile_all(programs, *args):
    """Compiles each program; returns `{name: (executable, compile_s, temp_mib)}`."""
    out = {}
    for name, fn in programs.items():
        t0 = time.perf_counter()
        exe = jax.jit(fn).lower(*args).compile()
        seconds = time.perf_counter() - t0
        jax.block_until_ready(exe(*args))  # warm up
        temp = exe.memory_analysis().temp_size_in_bytes / 2**20
        out[name] = (exe, seconds, temp)
    return out


def interleaved_medians(compiled, *args, repeats):
    """Median run time of each compiled program, timed in interleaved rounds so that
    machine noise hits all of them alike."""
    times = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, (exe, _, _) in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*args))
            times[name].append(time.perf_counter() - t0)
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
    exe = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(exe(*args))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    jax.block_until_ready(exe(*args))
    print(json.dumps({"peak_rss_mib": _status_mib("VmHWM")}))


def peak_rss_of(script, *argv):
    """Runs `python script *argv` (which ends in `report_peak_rss`) and returns MiB."""
    out = subprocess.run(
        [sys.executable, script, *argv], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]
