"""Sequence parallelism, the public wrappers: pad the time axis to whole blocks, run
`pscan.linear_recurrence` or `pscan.recurrence` under `jax.shard_map` with the solver's
`axis_name`, and unpad. The algorithms themselves live with the single-device ones
(`_linear.py`, `_solvers/`); what crosses devices is in `_axis.py`."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from ._arguments import check_flag
from ._eager import compiled_when_eager, compiles_once
from ._linear import linear_recurrence
from ._recurrence import raise_on_failure, recurrence
from ._segments import segment_masks
from ._solution import Solution
from ._solvers import AbstractShootingSolver, check_solver


def _check_axis(owner: str, mesh: Mesh, axis_name: str):
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"pscan.{owner}: `mesh` must be a jax.sharding.Mesh, got {mesh!r}"
        )
    if axis_name not in mesh.shape:
        raise ValueError(
            f"pscan.{owner}: `axis_name` {axis_name!r} is not an axis of the mesh (axes "
            f"{tuple(mesh.shape)})"
        )


def sharded_linear_recurrence(
    a,
    b,
    h0=None,
    *,
    mesh: Mesh,
    axis_name: str,
    reverse: bool = False,
    method: str = "auto",
    chunk_size: int | None = None,
    resets=None,
    length=None,
):
    """`pscan.linear_recurrence` with its time axis split over a mesh axis.

    Pads the time axis to a multiple of the number of devices along `axis_name` (the
    padding is processed after every real step, so it never changes a real state),
    runs `pscan.linear_recurrence(..., axis_name=axis_name)` under `shard_map`, and
    removes the padding. Inputs may live anywhere; the result is sharded over
    `axis_name` along time. Differentiable like `linear_recurrence`.

    **Arguments:**

    - `a`, `b`, `h0`, `reverse`, `method`, `chunk_size`, `resets`, `length`: as for
        `pscan.linear_recurrence`; `method` and `chunk_size` apply to each device's
        block.
    - `mesh`: a `jax.sharding.Mesh`.
    - `axis_name`: the mesh axis to split time over.

    **Returns:**

    `hs`, as `pscan.linear_recurrence` returns it.

    **Raises:**

    `ValueError` when `axis_name` is not an axis of `mesh`, and whatever
    `linear_recurrence` raises for its arguments.
    """
    _check_axis("sharded_linear_recurrence", mesh, axis_name)
    reverse = check_flag("sharded_linear_recurrence", "reverse", reverse)
    if jnp.ndim(b) == 0:
        raise ValueError(
            "pscan.sharded_linear_recurrence: `b` must have a leading time axis, got a scalar"
        )
    args = (a, b, h0, mesh, axis_name, reverse, method, chunk_size, resets, length)
    return _sharded_linear(*args)


# in eager mode compiled once for a configuration, not at every call
@compiled_when_eager
def _sharded_linear(
    a, b, h0, mesh, axis_name, reverse, method, chunk_size, resets, length
):
    b = jnp.asarray(b)
    a = jnp.asarray(a)
    steps = b.shape[0]
    devices = mesh.shape[axis_name]
    timed = a.ndim >= b.ndim and a.shape[0] == steps and steps > 1
    if h0 is None:
        h0 = jnp.zeros(b.shape[1:], b.dtype)
    pad = -steps % devices
    # padded steps come last in processing order: after the end, or before the start
    where = (pad, 0) if reverse else (0, pad)
    widths = lambda x: [where] + [(0, 0)] * (x.ndim - 1)
    b = jnp.pad(b, widths(b))
    if timed:
        a = jnp.pad(a, widths(a))
    time = PartitionSpec(axis_name)
    resets = _padded_resets("sharded_linear_recurrence", resets, steps, pad, reverse)
    if length is not None and reverse:  # the padding comes first in time
        length = jnp.asarray(length) + pad
    masks, mask_specs = _masks(resets, length, time)
    fn = lambda a, b, h0, masks: linear_recurrence(
        a,
        b,
        h0,
        reverse=reverse,
        method=method,
        chunk_size=chunk_size,
        axis_name=axis_name,
        **masks,
    )
    hs = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(
            time if timed else PartitionSpec(),
            time,
            PartitionSpec(),
            mask_specs,
        ),
        out_specs=time,
        check_vma=False,
    )(a, b, h0, masks)
    return hs[pad:] if reverse else hs[:steps]


def _padded_resets(owner, resets, steps: int, pad: int, front: bool = False):
    """`resets` checked and padded with `False` (at the front if `front`)."""
    if resets is None:
        return None
    resets = segment_masks(owner, steps, resets, None)[0]  # checked
    return jnp.pad(resets, (pad, 0) if front else (0, pad))


def _masks(resets, length, time):
    """The `resets` / `length` keywords and their `shard_map` specs (split over time,
    replicated)."""
    masks = {"resets": resets, "length": length}
    masks = {k: v for k, v in masks.items() if v is not None}
    specs = {"resets": time, "length": PartitionSpec()}
    return masks, {k: specs[k] for k in masks}


def sharded_recurrence(
    cell,
    xs,
    h0,
    *,
    solver,
    mesh: Mesh,
    axis_name: str,
    throw: bool = True,
    resets=None,
    length=None,
):
    """`pscan.recurrence` with its time axis split over a mesh axis.

    Every device runs the cell over its own chunks; per iteration the chunk-start
    states cross device boundaries (one `all_gather` of one state per device, plus the
    exchange of `pscan.linear_recurrence` for `Newton`), and convergence is decided
    for all devices at once. The gradient is the implicit one of `pscan.recurrence`, its
    boundary recurrence split the same way. Pads the time axis (with the last input, at
    the end) to a multiple of `devices * solver.chunk_size` and removes the padding.

    **Arguments:**

    - `cell`, `xs`, `h0`, `throw`, `resets`, `length`: as for `pscan.recurrence`.
    - `solver`: `pscan.Picard(...)`, `pscan.Newton(...)` or `pscan.ELK(...)` (without
        `fallback`); its `axis_name` is set to `axis_name`.
    - `mesh`: a `jax.sharding.Mesh`.
    - `axis_name`: the mesh axis to split time over.

    **Returns:**

    A `pscan.Solution`, `hs` split over `axis_name` along time.

    **Raises:**

    `ValueError` for a solver without parallelism across devices (`Sequential`), an
    `axis_name` not in `mesh`, and whatever `pscan.recurrence` raises.
    """
    check_solver("sharded_recurrence", solver, AbstractShootingSolver)
    throw = check_flag("sharded_recurrence", "throw", throw)
    _check_axis("sharded_recurrence", mesh, axis_name)
    leaves = jax.tree_util.tree_leaves(xs)
    if not leaves or jnp.ndim(leaves[0]) == 0:
        raise ValueError("pscan.sharded_recurrence: `xs` must have a leading time axis")
    args = (cell, xs, h0, solver, mesh, axis_name, throw, resets, length)
    if not compiles_once(cell):  # may read globals: traced at every eager call
        return _sharded_recurrence.__wrapped__(*args)
    return _sharded_recurrence(*args)


# in eager mode compiled once for a configuration, not at every call
@compiled_when_eager
def _sharded_recurrence(cell, xs, h0, solver, mesh, axis_name, throw, resets, length):
    solver = dataclasses.replace(solver, axis_name=axis_name)
    steps = jnp.shape(jax.tree_util.tree_leaves(xs)[0])[0]
    block = mesh.shape[axis_name] * solver.chunk_size
    pad = -steps % block
    resets = _padded_resets("sharded_recurrence", resets, steps, pad)

    def padded(x):
        x = jnp.asarray(x)
        tail = jnp.broadcast_to(x[-1:], (pad, *x.shape[1:]))
        return jnp.concatenate([x, tail]) if pad else x

    xs = jax.tree_util.tree_map(padded, xs)
    time = PartitionSpec(axis_name)

    masks, mask_specs = _masks(resets, length, time)

    def solve(cell, xs, h0, masks):
        sol = recurrence(cell, xs, h0, solver=solver, throw=False, **masks)
        return sol.hs, sol.result, sol.stats

    # traced even inside an eager call's trace of its own (an eager shard_map cannot
    # run the solver's custom VJP)
    hs, result, stats = eqx.filter_jit(
        jax.shard_map(
            solve,
            mesh=mesh,
            in_specs=(PartitionSpec(), time, PartitionSpec(), mask_specs),
            out_specs=(time, PartitionSpec(), PartitionSpec()),
            check_vma=False,
        )
    )(cell, xs, h0, masks)
    hs = jax.tree_util.tree_map(lambda x: x[:steps], hs)
    if throw:
        hs = raise_on_failure(hs, result)
    return Solution(hs=hs, result=result, stats=stats)
