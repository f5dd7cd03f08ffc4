"""How one gradient over a long sequence scales with its length.

An Elman network 32 -> 32 runs over a batch of 16 sequences; the loss is the sum of
every output, and we take its gradient with respect to the parameters, for lengths T
from 200 to 524288. Three ways to write it:

- **pscan**: `jax.vmap(pscan.nn.Recurrence(pscan.nn.ElmanCell(32, 32)))`, the default
  solver (on CPU: exact, sequential, checkpointed every ~sqrt(T) steps);
- **lax.scan**: the same cell in a hand-written `lax.scan`;
- **naive**: a preallocated (T, 16, 32) buffer written one step at a time inside
  `lax.fori_loop`. Reverse mode carries the buffer's cotangent through every step, so
  one gradient costs O(T^2); it stops once the next length would take over twice
  `--naive-limit` seconds.

Prints a table (compile time; gradient time, the median of `--repeats` rounds in which
the programs of one length run in turns, as `asv_bench/tables.py` times; peak memory of
the compiled gradient as XLA accounts it) and writes a log-log plot.

    python examples/seed_scaling.py                       # T = 200 ... 524288
    python examples/seed_scaling.py --max-length 3200     # quick
"""

import argparse
import statistics
import time

import jax
import jax.lax as lax
import jax.numpy as jnp

import pscan.nn as nn

BATCH, WIDTH = 16, 32


def lengths(max_length):
    out, t = [], 200
    while t <= max_length:
        out.append(t)
        t *= 2
    if out[-1] != max_length and max_length > 200:
        out.append(max_length)
    return out


def loss_pscan(cell, xs):
    return jnp.sum(jax.vmap(nn.Recurrence(cell))(xs))


def loss_scan(cell, xs):
    def one(xs):
        def body(h, x):
            h = cell(x, h)
            return h, h

        return lax.scan(body, cell.init_state(), xs)[1]

    return jnp.sum(jax.vmap(one)(xs))


def loss_naive(cell, xs):
    """The loop a newcomer writes: fill a preallocated buffer, one step at a time."""
    length = xs.shape[1]
    step = jax.vmap(cell, in_axes=(0, 0))

    def body(t, carry):
        h, buffer = carry
        h = step(xs[:, t], h)
        return h, buffer.at[t].set(h)

    h0 = jnp.zeros((BATCH, WIDTH), xs.dtype)
    buffer = jnp.zeros((length, BATCH, WIDTH), xs.dtype)
    return jnp.sum(lax.fori_loop(0, length, body, (h0, buffer))[1])


LOSSES = {"pscan": loss_pscan, "lax.scan": loss_scan, "naive": loss_naive}


def memory_mib(compiled):
    try:
        m = compiled.memory_analysis()
        total = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
        return total / 2**20
    except Exception:  # not every backend reports it
        return float("nan")


def measure(names, cell, xs, repeats):
    """`{name: (compile s, gradient s, peak MiB)}` of `jax.grad` of each loss at these
    shapes. Every program is compiled first, then the programs run in turns, `repeats`
    rounds, and each one's time is its median: the rule of `asv_bench/tables.py`, so
    that a slow moment of the machine falls on every column alike."""
    compiled, compile_s = {}, {}
    for name in names:
        start = time.perf_counter()
        compiled[name] = jax.jit(jax.grad(LOSSES[name])).lower(cell, xs).compile()
        compile_s[name] = time.perf_counter() - start
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](cell, xs))
            times[name].append(time.perf_counter() - start)
    return {
        name: (
            compile_s[name],
            statistics.median(times[name]),
            memory_mib(compiled[name]),
        )
        for name in names
    }


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, rows in results.items():
        if rows:
            ts = [t for t, *_ in rows]
            ax.loglog(ts, [g for _, _, g, _ in rows], "o-", label=name)
    t_ref = [t for t, *_ in results["pscan"]]
    if t_ref:
        g0 = results["pscan"][0][2]
        ax.loglog(t_ref, [g0 * t / t_ref[0] for t in t_ref], "k:", lw=1, label="~ T")
    if results["naive"]:
        t0, _, g0, _ = results["naive"][-1]
        ts = [t for t, *_ in results["naive"]]
        ax.loglog(ts, [g0 * (t / t0) ** 2 for t in ts], "k--", lw=1, label="~ T^2")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("one gradient (s)")
    ax.set_title(f"Elman {WIDTH}->{WIDTH}, batch {BATCH}, grad of sum(outputs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-length", type=int, default=524288)
    parser.add_argument(
        "--naive-limit",
        type=float,
        default=60.0,
        help="stop the naive loop near this many seconds per gradient",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed rounds per length (median)"
    )
    parser.add_argument("--skip-scan", action="store_true", help="no lax.scan column")
    parser.add_argument("--plot", default="seed_scaling.png")
    args = parser.parse_args()

    cell = nn.ElmanCell(WIDTH, WIDTH, key=jax.random.PRNGKey(0), dtype=jnp.float32)
    key = jax.random.PRNGKey(1)
    results = {name: [] for name in LOSSES}
    running = {name: True for name in LOSSES}
    running["lax.scan"] = not args.skip_scan
    print(
        f"# Elman {WIDTH}->{WIDTH}, batch {BATCH}, float32, jax {jax.__version__}, "
        f"backend {jax.default_backend()}"
    )
    print("| T | method | compile (s) | gradient (s) | peak memory (MiB) | vs naive |")
    print("|---|---|---|---|---|---|")
    for t in lengths(args.max_length):
        xs = jax.random.normal(key, (BATCH, t, WIDTH), jnp.float32)
        names = [name for name in ("naive", "lax.scan", "pscan") if running[name]]
        measured = measure(names, cell, xs, args.repeats)
        naive_s = measured["naive"][1] if "naive" in measured else None
        for name, (compile_s, grad_s, mib) in measured.items():
            results[name].append((t, compile_s, grad_s, mib))
            speedup = f"{naive_s / grad_s:.0f}x" if naive_s and name != "naive" else ""
            print(
                f"| {t} | {name} | {compile_s:.2f} | {grad_s:.4f} | {mib:.0f} | "
                f"{speedup} |",
                flush=True,
            )
        # stop the quadratic loop once the next length would pass the limit
        if naive_s is not None and naive_s * 4 > 2 * args.naive_limit:
            running["naive"] = False
    rows = results["pscan"]
    doubling = [
        (g2 / g1) / (t2 / t1) * 2
        for (t1, _, g1, _), (t2, _, g2, _) in zip(rows, rows[1:])
        if t1 >= 3200
    ]
    if doubling:
        print(
            f"pscan, time for twice the length (T >= 3200): at most "
            f"{max(doubling):.2f}x (linear = 2x)"
        )
    plot(results, args.plot)


if __name__ == "__main__":
    main()
