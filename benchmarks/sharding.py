"""Sequence parallelism: `pscan.sharded_linear_recurrence` over 1, 2 and 4 forced host
devices, T = 2^20, d = 32, float32, forward and gradient with respect to (a, b).

    python benchmarks/sharding.py                 # 1, 2, 4 devices
    python benchmarks/sharding.py --length 4096   # quick

Each device count runs in its own process (`--xla_force_host_platform_device_count` is
read when JAX starts). On a CPU the "devices" share the machine's cores, so the gain is
bounded by the cores (2 here).
"""

import argparse
import os
import subprocess
import sys


def child(args):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.child}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from _measure import compile_all, interleaved_medians

    import pscan

    mesh = Mesh(np.array(jax.devices()), ("time",))
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.uniform(ka, (args.length, args.channels), minval=0.5, maxval=0.99)
    b = jax.random.normal(kb, (args.length, args.channels))
    # the inputs already live split over the devices, as they would in a real job
    split = NamedSharding(mesh, PartitionSpec("time"))
    a, b = jax.device_put(a, split), jax.device_put(b, split)
    f = lambda a, b: pscan.sharded_linear_recurrence(a, b, mesh=mesh, axis_name="time")
    programs = {
        "fwd": f,
        "grad": jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1)),
        "plain fwd": pscan.linear_recurrence,
        "plain grad": jax.grad(
            lambda a, b: jnp.sum(pscan.linear_recurrence(a, b) ** 2), argnums=(0, 1)
        ),
    }
    if args.child > 1:  # the single-device reference only runs in the 1-device process
        programs = {k: v for k, v in programs.items() if not k.startswith("plain")}
    compiled = compile_all(programs, a, b)
    med = interleaved_medians(compiled, a, b, repeats=args.repeats)
    plain = f"{med['plain fwd']} {med['plain grad']}" if args.child == 1 else ""
    print(f"RESULT {args.child} {med['fwd']} {med['grad']} {plain}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2**20)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--devices", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    rows = []
    for n in [int(x) for x in args.devices.split(",")]:
        out = subprocess.run(
            [sys.executable, __file__, "--length", str(args.length), "--channels",
             str(args.channels), "--repeats", str(args.repeats), "--child", str(n)],
            capture_output=True, text=True, check=True,
        )
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1]
        _, _, fwd, grad, *plain = line.split()
        if plain:
            rows.append(("plain linear_recurrence", *map(float, plain)))
        rows.append((n, float(fwd), float(grad)))
    print(f"# sharded_linear_recurrence, T = {args.length}, d = {args.channels}, "
          f"float32, forced host devices, median of {args.repeats}")
    print("| devices | fwd (ms) | fwd vs plain | grad (ms) | grad vs plain |")
    print("|---|---|---|---|---|")
    for n, fwd, grad in rows:
        print(f"| {n} | {fwd * 1e3:.1f} | {rows[0][1] / fwd:.2f}x | {grad * 1e3:.1f} | "
              f"{rows[0][2] / grad:.2f}x |")
    print("(`vs plain`: the single-device `pscan.linear_recurrence` time over this one)")


if __name__ == "__main__":
    main()
