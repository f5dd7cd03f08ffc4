"""Run by tests/test_sharding.py in a subprocess with 4 forced host devices, one part
(`linear`, `nonlinear`, `elk` or `segmented`) per process: sharded recurrences equal the
single-device ones, values and gradients."""

import itertools
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import pscan  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers import make_linear_problem, random_cotangent  # noqa: E402


def grad(f, argnums=0):
    """`jax.grad`, compiled: one program, not one dispatch per operation."""
    import equinox as eqx

    return eqx.filter_jit(jax.grad(f, argnums=argnums))


def grads(f):
    """The gradient of `f(cell, xs, h0)` wrt all three (the cell's floating leaves),
    compiled as one program: one compile, not one per argument."""
    import equinox as eqx

    return eqx.filter_jit(eqx.filter_grad(lambda args: f(*args)))


def close_grads(g, g_ref, what):
    """`grads` results: the cell's, then `xs`'s and `h0`'s gradients."""
    names = ("the cell", "xs", "h0")
    for name, x, y in zip(names, g, g_ref):
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
            close(a, b, f"{what}: gradient wrt {name}")


def close(x, y, what):
    np.testing.assert_allclose(
        np.asarray(x), np.asarray(y), rtol=1e-9, atol=1e-9, err_msg=what
    )


def linear(mesh):
    """The linear recurrence across devices: every kind of `a`, both directions,
    sequential and chunked, values and gradients; the user's own shard_map."""
    cases = itertools.product(
        [1, 7, 37, 130],  # T not a multiple of 4 x chunk size
        ["diagonal", "scalar", "shared", "dense"],
        [False, True],
        ["sequential", "chunked"],
    )
    count = 0
    for length, kind, reverse, method in cases:
        # every kind and direction at T = 1 and 37; the rest on a few kinds only
        if method == "chunked" and (length != 37 or kind in ("scalar", "shared")):
            continue
        if length in (7, 130) and (kind, method) != ("diagonal", "sequential"):
            continue
        problem_kind = "diagonal" if kind == "shared" else kind
        a, b, h0 = make_linear_problem(length, length, (2, 3), problem_kind)
        if kind == "shared":
            a = a[0]
        opts = dict(
            reverse=reverse,
            method=method,
            chunk_size=4 if method == "chunked" else None,
        )
        cot = random_cotangent(1, b)

        def loss(f):
            return lambda a, b, h0: jnp.sum(cot * f(a, b, h0))

        single = lambda a, b, h0: pscan.linear_recurrence(a, b, h0, **opts)
        sharded = lambda a, b, h0: pscan.sharded_linear_recurrence(
            a, b, h0, mesh=mesh, axis_name="time", **opts
        )
        what = f"T={length} {kind} reverse={reverse} {method}"
        close(jax.jit(sharded)(a, b, h0), single(a, b, h0), what)
        g = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(a, b, h0)
        g_ref = grad(loss(single), argnums=(0, 1, 2))(a, b, h0)
        for x, y, name in zip(g, g_ref, "a b h0".split()):
            close(x, y, f"{what}: gradient wrt {name}")
        count += 1
    # inside the user's own shard_map, with axis_name; and forward mode
    a, b, h0 = make_linear_problem(0, 64, (3,))
    time = PartitionSpec("time")
    f = jax.shard_map(
        lambda a, b, h0: pscan.linear_recurrence(a, b, h0, axis_name="time"),
        mesh=mesh,
        in_specs=(time, time, PartitionSpec()),
        out_specs=time,
        check_vma=False,
    )
    close(jax.jit(f)(a, b, h0), pscan.linear_recurrence(a, b, h0), "user shard_map")
    # shard_map's own variance checks on (its default)
    f_checked = jax.shard_map(
        lambda a, b, h0: pscan.linear_recurrence(a, b, h0, axis_name="time"),
        mesh=mesh,
        in_specs=(time, time, PartitionSpec()),
        out_specs=time,
    )
    close(
        jax.jit(f_checked)(a, b, h0),
        pscan.linear_recurrence(a, b, h0),
        "user shard_map, checked",
    )
    g = grad(lambda a, b: jnp.sum(f_checked(a, b, h0) ** 2), argnums=(0, 1))(a, b)
    g_ref = grad(
        lambda a, b: jnp.sum(pscan.linear_recurrence(a, b, h0) ** 2), argnums=(0, 1)
    )(a, b)
    close(g[0], g_ref[0], "checked shard_map gradient")
    tangents = tuple(random_cotangent(i, x) for i, x in enumerate((a, b, h0)))
    _, t = jax.jvp(f, (a, b, h0), tangents)
    _, t_ref = jax.jvp(pscan.linear_recurrence, (a, b, h0), tangents)
    close(t, t_ref, "jvp")
    # derivatives through a zero initial state (a learnable h0 at its usual first
    # value) and through an exact zero coefficient, both modes: the boundary loop's
    # zero guards, differentiated as they stood, dropped them
    a0, h00 = jnp.asarray(a).at[21].set(0.0), jnp.zeros_like(h0)
    loss0 = lambda f: lambda a, h0: jnp.sum(jnp.sin(f(a, b, h0)))
    g = grad(loss0(f), argnums=(0, 1))(a0, h00)
    g_ref = grad(loss0(pscan.linear_recurrence), argnums=(0, 1))(a0, h00)
    close(g[0], g_ref[0], "zero coefficient: gradient wrt a")
    close(g[1], g_ref[1], "zero h0: gradient wrt h0")
    _, t = jax.jvp(f, (a0, b, h00), tangents)
    _, t_ref = jax.jvp(pscan.linear_recurrence, (a0, b, h00), tangents)
    close(t, t_ref, "zero coefficient and h0: jvp")
    # any associative combine across devices (affine maps, not commutative), checked
    combine = lambda e, later: (later[0] * e[0], later[0] * e[1] + later[1])
    for method, reverse in itertools.product(
        ["sequential", "associative", "chunked"], [False, True]
    ):
        scan = lambda e, axis_name=None: pscan.associative_scan(
            combine, e, reverse=reverse, method=method, axis_name=axis_name
        )
        g = jax.shard_map(
            lambda a, b: scan((a, b), "time"),
            mesh=mesh,
            in_specs=(time, time),
            out_specs=time,
        )
        for x, y in zip(jax.jit(g)(a, b), scan((a, b))):
            close(x, y, f"associative_scan {method} reverse={reverse}")
    return count + 4


def nonlinear(mesh, elk=False):
    """Picard and Newton (`elk=False`) or ELK (`elk=True`) across devices: states and
    implicit gradients equal the exact single-device ones (ELK in as many iterations
    as on one device); a user's own shard_map with `axis_name` works too."""
    import equinox as eqx

    cell = eqx.nn.GRUCell(2, 3, key=jax.random.PRNGKey(0), dtype=jnp.float64)
    tol = dict(rtol=1e-12, atol=1e-12)
    family = lambda solvers: [s for s in solvers if isinstance(s, pscan.ELK) == elk]
    # the second one also runs at T = 5
    solvers = family(
        [
            pscan.Picard(chunk_size=4, **tol),
            pscan.Newton(chunk_size=4, **tol),
            pscan.Newton(chunk_size=3, jacobian="diagonal", **tol),
            pscan.ELK(**tol),
            pscan.ELK(chunk_size=4, **tol),
            pscan.ELK(chunk_size=3, jacobian="diagonal", **tol),
        ]
    )
    count = 0
    for length in (5, 37):
        xs = jax.random.normal(jax.random.PRNGKey(length), (length, 2), jnp.float64)
        h0 = 0.1 * jnp.ones(3)
        w = jax.random.normal(jax.random.PRNGKey(3), (length, 3), jnp.float64)
        exact = lambda c, xs, h0: pscan.recurrence(c, xs, h0).hs
        for solver in solvers if length == 37 else solvers[1:2]:
            solve = lambda c, xs, h0, s=solver: pscan.sharded_recurrence(
                c, xs, h0, solver=s, mesh=mesh, axis_name="time"
            )
            sharded = lambda c, xs, h0: solve(c, xs, h0).hs
            what = f"T={length} {solver}"
            run = eqx.filter_jit(solve)
            many = run(cell, xs, h0)
            close(many.hs, exact(cell, xs, h0), what)
            assert many.result == pscan.RESULTS.successful, what
            if length == 37:
                # a NaN inside the last device's last chunk (every chunk start
                # finite): the loop's states, flagged on every device (the flag was
                # the first device's alone, `successful`)
                nan_xs = xs.at[length - 2, 0].set(jnp.nan)
                nan_sol = run(cell, nan_xs, h0)
                close(nan_sol.hs, exact(cell, nan_xs, h0), f"{what}: NaN input")
                assert nan_sol.result == pscan.RESULTS.nonfinite, f"{what}: NaN input"
            if isinstance(solver, pscan.ELK):
                # the same iteration as on one device (the chunk starts padded to
                # whole blocks, as sharded_recurrence pads them)
                block = mesh.shape["time"] * solver.chunk_size
                padded = jnp.concatenate([xs, jnp.repeat(xs[-1:], -length % block, 0)])
                one = pscan.recurrence(cell, padded, h0, solver=solver)
                n_one = int(one.stats["num_iterations"])
                n_many = int(many.stats["num_iterations"])
                assert n_one == n_many, f"{what}: {n_many} iterations, {n_one} on one"
                assert n_one > 1, what
                if solver.chunk_size > 1 or length < 37:
                    # the derivatives are Newton's with these Jacobians (the fixed
                    # point is the same), checked across devices by `nonlinear`
                    count += 1
                    continue
            loss = lambda f: lambda c, xs, h0: jnp.sum(w * f(c, xs, h0))
            g = grads(loss(sharded))((cell, xs, h0))
            close_grads(g, grads(loss(exact))((cell, xs, h0)), what)
            # forward mode, implicit like the gradient
            tangents = (jnp.cos(xs), jnp.ones(3))
            t = jax.jvp(lambda xs, h0: sharded(cell, xs, h0), (xs, h0), tangents)[1]
            t_ref = jax.jvp(lambda xs, h0: exact(cell, xs, h0), (xs, h0), tangents)[1]
            close(t, t_ref, f"{what}: jvp")
            count += 1
    if elk:
        # ELK on a chaotic GRU, where its trust region and its choices between
        # candidates act: the same iterates across devices as on one, to rounding
        wild = eqx.tree_at(lambda c: c.weight_hh, cell, 3.0 * cell.weight_hh)
        xs_w = jax.random.normal(jax.random.PRNGKey(1), (120, 2), jnp.float64)
        for chunk in (1, 2):
            solver = pscan.ELK(chunk_size=chunk, rtol=1e-10, atol=1e-10, max_iters=121)
            one = pscan.recurrence(wild, xs_w, h0, solver=solver)
            many = pscan.sharded_recurrence(
                wild, xs_w, h0, solver=solver, mesh=mesh, axis_name="time"
            )
            n_one = int(one.stats["num_iterations"])
            n_many = int(many.stats["num_iterations"])
            what = f"chaotic {solver}"
            assert n_one == n_many > 10, f"{what}: {n_many} iterations, {n_one}"
            err = float(jnp.max(jnp.abs(one.hs - many.hs)))
            assert err < 1e-13, f"{what}: {err} from one device's"
    # called eagerly (outside any jit)
    eager = pscan.sharded_recurrence(
        cell, xs, h0, solver=solvers[0], mesh=mesh, axis_name="time"
    )
    close(eager.hs, exact(cell, xs, h0), "eager")
    # the user's own shard_map, 8 steps per device
    xs = jax.random.normal(jax.random.PRNGKey(9), (32, 2), jnp.float64)
    h0 = jnp.zeros(3)
    time = PartitionSpec("time")
    loss = lambda f: lambda c, xs, h0: jnp.sum(f(c, xs, h0) ** 2)
    exact = lambda c, xs, h0: pscan.recurrence(c, xs, h0).hs
    g_ref = grads(loss(exact))((cell, xs, h0))
    if not elk:
        solver = pscan.Newton(chunk_size=4, axis_name="time", **tol)
        user = lambda c, xs, h0: (
            pscan.recurrence(c, xs, h0, solver=solver, throw=False).hs
        )
        specs = dict(in_specs=(PartitionSpec(), time, PartitionSpec()), out_specs=time)
        f = jax.shard_map(user, mesh=mesh, check_vma=False, **specs)
        close(eqx.filter_jit(f)(cell, xs, h0), exact(cell, xs, h0), "user")
        # shard_map's own variance checks on (its default)
        f_checked = jax.shard_map(user, mesh=mesh, **specs)
        close_grads(grads(loss(f_checked))((cell, xs, h0)), g_ref, "checked")
        t = jax.jvp(lambda xs: f_checked(cell, xs, h0), (xs,), (jnp.sin(xs),))[1]
        t_ref = jax.jvp(lambda xs: exact(cell, xs, h0), (xs,), (jnp.sin(xs),))[1]
        close(t, t_ref, "checked: jvp")
    # Picard, the diagonal Jacobians and ELK there too (their derivatives iterate),
    # with the default run-time check (`throw=True`)
    for other in family(
        [
            pscan.Picard(chunk_size=4, axis_name="time", **tol),
            pscan.Newton(chunk_size=4, jacobian="diagonal", axis_name="time", **tol),
            pscan.ELK(chunk_size=2, axis_name="time", **tol),
            pscan.ELK(jacobian="diagonal", axis_name="time", **tol),
        ]
    ):
        f_other = jax.shard_map(
            lambda c, xs, h0, s=other: pscan.recurrence(c, xs, h0, solver=s).hs,
            mesh=mesh,
            in_specs=(PartitionSpec(), time, PartitionSpec()),
            out_specs=time,
        )
        close_grads(grads(loss(f_other))((cell, xs, h0)), g_ref, f"checked {other}")
    if elk:
        return count + 1
    # a warm start at the answer converges in one sweep, where the gradient's own
    # iteration cannot: it goes on past `max_iters`, across the devices, until exact
    hs_exact = pscan.recurrence(cell, xs, h0).hs
    one = pscan.Picard(chunk_size=4, max_iters=1, axis_name="time", **tol)
    f_one = jax.shard_map(
        lambda c, xs, h0, g: pscan.recurrence(c, xs, h0, solver=one, guess=g).hs,
        mesh=mesh,
        in_specs=(PartitionSpec(), time, PartitionSpec(), time),
        out_specs=time,
        check_vma=False,
    )
    g = grad(
        lambda xs, h0: jnp.sum(f_one(cell, xs, h0, hs_exact) ** 2), argnums=(0, 1)
    )(xs, h0)
    close(g[0], g_ref[1], "iteration to exactness: gradient wrt xs")
    close(g[1], g_ref[2], "iteration to exactness: gradient wrt h0")
    # each device's block must be whole chunks
    bad = pscan.Newton(chunk_size=3, axis_name="time")
    g = jax.shard_map(
        lambda c, xs, h0: pscan.recurrence(c, xs, h0, solver=bad, throw=False).hs,
        mesh=mesh,
        in_specs=(PartitionSpec(), time, PartitionSpec()),
        out_specs=time,
        check_vma=False,
    )
    try:
        eqx.filter_jit(g)(cell, xs, h0)
    except ValueError as e:
        assert "multiple of `chunk_size` (3), got 8 steps" in str(e), e
    else:
        raise AssertionError("no ValueError for blocks that are not whole chunks")
    return count + 1


def segmented(mesh):
    """Resets (one at a device boundary, one inside a block) and a length across
    devices: states and gradients equal the single-device ones, both directions,
    and inside the user's shard_map with its variance checks on."""
    import equinox as eqx

    length = 37
    resets = np.isin(np.arange(length), [0, 10, 17, 30])  # 10: a block boundary
    masks = dict(resets=resets, length=33)
    a, b, h0 = make_linear_problem(5, length, (3,))
    count = 0
    for reverse, method in itertools.product([False, True], ["sequential", "chunked"]):
        opts = dict(reverse=reverse, method=method, **masks)
        if method == "chunked":
            opts["chunk_size"] = 3
        single = lambda a, b, h0: pscan.linear_recurrence(a, b, h0, **opts)
        sharded = lambda a, b, h0: pscan.sharded_linear_recurrence(
            a, b, h0, mesh=mesh, axis_name="time", **opts
        )
        what = f"segments reverse={reverse} {method}"
        close(jax.jit(sharded)(a, b, h0), single(a, b, h0), what)
        loss = lambda f: lambda a, b, h0: jnp.sum(jnp.sin(f(a, b, h0)))
        g = grad(loss(sharded), argnums=(0, 1, 2))(a, b, h0)
        g_ref = grad(loss(single), argnums=(0, 1, 2))(a, b, h0)
        for x, y, name in zip(g, g_ref, "a b h0".split()):
            close(x, y, f"{what}: gradient wrt {name}")
        count += 1
    # dense coefficients, a NaN in `b` in the first block and one in `a` after the
    # reset that starts the second: neither reaches a later segment (the second
    # block's coefficient is zero, not NaN, and the zero matrices are guarded)
    a, b, h0 = make_linear_problem(5, length, (3,), kind="dense")
    b[4, 1] = np.nan
    a[12, 0, 0] = np.nan
    for method in ("sequential", "chunked"):
        opts = dict(method=method, resets=resets)
        single = pscan.linear_recurrence(a, b, h0, **opts)
        assert np.isfinite(single[17:]).all() and np.isnan(single[4]).any()
        sharded = pscan.sharded_linear_recurrence(
            a, b, h0, mesh=mesh, axis_name="time", **opts
        )
        close(sharded, single, f"dense segments with NaN, {method}")
        count += 1
    cell = eqx.nn.GRUCell(2, 3, key=jax.random.PRNGKey(0), dtype=jnp.float64)
    xs = jax.random.normal(jax.random.PRNGKey(1), (length, 2), jnp.float64)
    h0 = 0.1 * jnp.ones(3)
    tol = dict(rtol=1e-12, atol=1e-12)
    exact = lambda c, xs, h0: pscan.recurrence(c, xs, h0, **masks).hs
    loss = lambda f: lambda c, xs, h0: jnp.sum(jnp.sin(f(c, xs, h0)))
    for solver in (
        pscan.Picard(chunk_size=3, **tol),
        pscan.Newton(chunk_size=2, **tol),
    ):
        sharded = lambda c, xs, h0, s=solver: (
            pscan.sharded_recurrence(
                c, xs, h0, solver=s, mesh=mesh, axis_name="time", **masks
            ).hs
        )
        what = f"segments {solver}"
        close(eqx.filter_jit(sharded)(cell, xs, h0), exact(cell, xs, h0), what)
        g = grad(loss(sharded), argnums=(1, 2))(cell, xs, h0)
        g_ref = grad(loss(exact), argnums=(1, 2))(cell, xs, h0)
        close(g[0], g_ref[0], f"{what}: gradient wrt xs")
        close(g[1], g_ref[1], f"{what}: gradient wrt h0")
        count += 1
    # the user's own shard_map, checked, 8 steps per device, resets as an input
    xs, resets = xs[:32], resets[:32]
    time = PartitionSpec("time")
    solver = pscan.Newton(chunk_size=4, axis_name="time", **tol)
    f_checked = jax.shard_map(
        lambda c, xs, h0, r: (
            pscan.recurrence(
                c, xs, h0, solver=solver, throw=False, resets=r, length=29
            ).hs
        ),
        mesh=mesh,
        in_specs=(PartitionSpec(), time, PartitionSpec(), time),
        out_specs=time,
    )
    ref = lambda c, xs, h0: pscan.recurrence(c, xs, h0, resets=resets, length=29).hs
    mine = lambda c, xs, h0: f_checked(c, xs, h0, resets)
    close(mine(cell, xs, h0), ref(cell, xs, h0), "segments checked")
    g = grad(loss(mine), argnums=(1, 2))(cell, xs, h0)
    g_ref = grad(loss(ref), argnums=(1, 2))(cell, xs, h0)
    close(g[0], g_ref[0], "segments checked: gradient wrt xs")
    close(g[1], g_ref[1], "segments checked: gradient wrt h0")
    return count + 1


if __name__ == "__main__":
    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("time",))
    part = {
        "linear": linear,
        "nonlinear": nonlinear,
        "elk": lambda mesh: nonlinear(mesh, elk=True),
        "segmented": segmented,
    }
    print(f"OK {part[sys.argv[1]](mesh)} cases")
