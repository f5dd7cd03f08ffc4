"""Benchmark the nonlinear solvers of `pscan.recurrence`, in one run.

    python benchmarks/nonlinear.py solvers      # GRU 1 -> 32, T = 65536, every solver
    python benchmarks/nonlinear.py checkpoint   # the seed scenario: Elman 32 -> 32, batch 16, T = 524288

`solvers`: iterations to converge, forward and gradient time of each solver against
`Sequential` (a plain `lax.scan`), and the memory its Jacobians take.
`checkpoint`: gradient of `sum(hs)` with respect to the cell's parameters with
`pscan.nn.Recurrence(ElmanCell)` (default solver: `Sequential(checkpoint=~sqrt(T))`, the
input projection hoisted out of the loop) and with `Sequential(checkpoint=C)` on a cell
pscan cannot split, against autodiff through a hand-written `lax.scan`; time in one run,
peak RSS in separate processes.
"""

import argparse

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from _measure import compile_all, interleaved_medians, peak_rss_of, report_peak_rss

import pscan


def gru_problem(length, hidden):
    cell = eqx.nn.GRUCell(1, hidden, key=jax.random.PRNGKey(0))
    xs = jax.random.normal(jax.random.PRNGKey(1), (length, 1))
    return cell, xs, jnp.zeros(hidden)


def solvers(args):
    tol = dict(rtol=args.tol, atol=args.tol)
    candidates = {
        "Sequential": pscan.Sequential(),
        f"Picard(chunk_size={args.chunk})": pscan.Picard(chunk_size=args.chunk, **tol),
        f"Newton(chunk_size={args.chunk})": pscan.Newton(chunk_size=args.chunk, **tol),
        f"Newton(chunk_size={args.chunk}, diagonal)": pscan.Newton(
            chunk_size=args.chunk, jacobian="diagonal", **tol
        ),
        "Newton() = DEER": pscan.Newton(**tol),
        "Newton(diagonal) = quasi-DEER": pscan.Newton(jacobian="diagonal", **tol),
    }
    skip = set(args.skip.split(",")) if args.skip else set()
    cell, xs, h0 = gru_problem(args.length, args.hidden)
    programs, iterations = {}, {}
    for name, solver in candidates.items():
        if any(s and s in name for s in skip):
            continue
        sol = eqx.filter_jit(pscan.recurrence)(cell, xs, h0, solver=solver, throw=False)
        ref = eqx.filter_jit(pscan.recurrence)(cell, xs, h0)
        err = float(jnp.max(jnp.abs(sol.hs - ref.hs)))
        iterations[name] = (int(sol.stats["num_iterations"]), err, sol.result)
        programs[name, "fwd"] = lambda c, xs, s=solver: pscan.recurrence(
            c, xs, h0, solver=s
        ).hs
        programs[name, "grad"] = lambda c, xs, s=solver: eqx.filter_grad(
            lambda c: jnp.sum(pscan.recurrence(c, xs, h0, solver=s).hs)
        )(c)
    compiled = compile_all(programs, cell, xs)
    med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
    d, t = args.hidden, args.length
    print(
        f"# GRU 1 -> {d}, T = {t}, float32, tol {args.tol}, jax {jax.__version__}, "
        f"backend {jax.default_backend()}, median of {args.repeats} interleaved runs"
    )
    print(
        "| solver | iterations | max abs err vs Sequential | fwd (ms) | fwd vs Sequential "
        "| grad (ms) | grad vs Sequential | grad / fwd | Jacobians (MiB) | XLA temp fwd (MiB) |"
    )
    print("|---" * 10 + "|")
    base_f, base_g = med["Sequential", "fwd"], med["Sequential", "grad"]
    for name, (iters, err, _) in iterations.items():
        f, g = med[name, "fwd"], med[name, "grad"]
        solver = candidates[name]
        if isinstance(solver, pscan.Newton):
            k = -(-t // solver.chunk_size)
            per = d * d if solver.jacobian == "dense" else d
            jac = f"{k * per * 4 / 2**20:.1f}"
        else:
            jac = "0"
        print(
            f"| {name} | {iters} | {err:.1e} | {f * 1e3:.0f} | {f / base_f:.2f}x | "
            f"{g * 1e3:.0f} | {g / base_g:.2f}x | {g / f:.2f} | {jac} | "
            f"{compiled[name, 'fwd'][2]:.0f} |",
            flush=True,
        )


class Unsplit(eqx.Module):
    """A cell seen only as `cell(x, h)`: pscan cannot hoist its input projection."""

    cell: eqx.Module

    def __call__(self, x, h):
        return self.cell(x, h)


def elman_problem(length, batch, width):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    cell = pscan.nn.ElmanCell(width, width, key=k1, dtype=jnp.float32)
    cell = eqx.tree_at(
        lambda c: (c.weight_ih, c.weight_hh, c.bias),
        cell,
        (
            jax.random.normal(k1, (width, width)) / width**0.5,
            0.9 * jax.random.normal(k2, (width, width)) / width**0.5,
            jnp.zeros(width),
        ),
    )
    xs = jax.random.normal(k3, (batch, length, width))
    return cell, xs


def checkpoint_programs(width, every):
    """The seed scenario's gradient, three ways: a hand-written `lax.scan` of the
    cell, the `pscan.nn.Recurrence` layer with its default solver, and
    `Sequential(checkpoint=every)` on the cell seen only as `cell(x, h)`."""
    h0 = jnp.zeros(width)

    def plain(cell, xs):
        def one(xs):
            def step(h, x):
                h = cell(x, h)
                return h, h

            return lax.scan(step, h0, xs)[1]

        return jnp.sum(jax.vmap(one)(xs))

    def layer(cell, xs):
        return jnp.sum(jax.vmap(pscan.nn.Recurrence(cell))(xs))

    def unsplit(cell, xs):
        solver = pscan.Sequential(checkpoint=every)
        one = lambda xs: pscan.recurrence(Unsplit(cell), xs, h0, solver=solver).hs
        return jnp.sum(jax.vmap(one)(xs))

    return {
        "lax.scan": jax.grad(plain),
        "Recurrence(ElmanCell)": jax.grad(layer),
        f"Sequential(checkpoint={every}), unsplit cell": jax.grad(unsplit),
    }


def checkpoint(args):
    cell, xs = elman_problem(args.length, args.batch, args.hidden)
    programs = checkpoint_programs(args.hidden, args.every)
    if args.child:
        return report_peak_rss(programs[args.child], cell, xs)
    compiled = compile_all(programs, cell, xs)
    med = interleaved_medians(compiled, cell, xs, repeats=args.repeats)
    rss = {
        name: peak_rss_of(
            __file__, "checkpoint", "--length", str(args.length), "--batch",
            str(args.batch), "--hidden", str(args.hidden), "--every", str(args.every),
            "--child", name,
        )
        for name in programs
    }
    print(
        f"# Elman {args.hidden} -> {args.hidden}, batch {args.batch}, T = {args.length}, "
        f"gradient of sum(hs), jax {jax.__version__}, median of {args.repeats}"
    )
    print("| program | grad (s) | vs lax.scan | peak RSS (MiB) | vs lax.scan | XLA temp (MiB) |")
    print("|---|---|---|---|---|---|")
    for name in programs:
        print(
            f"| {name} | {med[name]:.2f} | {med[name] / med['lax.scan']:.2f}x | "
            f"{rss[name]:.0f} | {rss[name] / rss['lax.scan']:.2f}x | "
            f"{compiled[name][2]:.0f} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("solvers")
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated name fragments")
    p = sub.add_parser("checkpoint")
    p.add_argument("--length", type=int, default=524288)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--every", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    solvers(args) if args.what == "solvers" else checkpoint(args)


if __name__ == "__main__":
    main()
