"""Chunk Jacobians as small linear operators: `DenseJacobian`, `DiagonalJacobian`.

A shooting solver linearises every chunk map `F_k` at its start, `J_k = dF_k/ds`. The
operators below hold the K Jacobians (or an approximation of them) with the few
operations that the forward step, the tangent and the adjoint all use: a product
`mv`, a `transpose`, a scaling, and the coefficients of the linear recurrence over the
chunks (`pscan.linear_recurrence` takes them as its `a`). Which one a solver uses is a
type, never a string: `exact` says whether it is the Jacobian itself (the boundary
recurrences are then solved at once) or an approximation (a preconditioner of an
iteration that uses exact products).
"""

import abc
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._chunking import chunk_length, group_start, map_in_groups
from .._finite import finite_along


class AbstractJacobian(eqx.Module):
    """The K chunk Jacobians `J_k` of a shooting solver, one structure.

    Subclasses hold the operator and say how to build it (`linearise`), apply it
    (`mv`), transpose it and hand it to `pscan.linear_recurrence` (`coefficients`).
    """

    exact: ClassVar[bool]

    @classmethod
    @abc.abstractmethod
    def linearise(
        cls,
        f: Callable,
        starts: Array,
        xs: PyTree,
        *,
        transposed: bool = False,
        value: bool = False,
    ) -> "AbstractJacobian | tuple":
        """The operator of `f(s, x_k)` at every `starts[k]`, `f` vectorised over k.

        **Arguments:**

        - `f`: one chunk's map `f(s, x_k) -> end`, or `-> (end, extra)` where `extra`
            is a scalar: then the derivative of `extra` comes along (`(operator, grad)`).
        - `starts`: `(K, d)`.
        - `xs`: the chunks' inputs, leading axis K.
        - `transposed`: build `J_k^T` instead of `J_k`.
        - `value`: also return `f` at every start, which the forward-mode pass
            computes anyway (no second run of the chunks).

        **Returns:**

        The operator, or `(operator, d extra / ds)` when `f` returns a pair; with
        `value`, `f`'s values (leading axis K) appended: `(operator, values)` or
        `(operator, d extra / ds, values)`.
        """

    @abc.abstractmethod
    def mv(self, v: Array) -> Array:
        """The products with every chunk's Jacobian.

        **Returns:**

        `J_k v[k]` for every k, `(K, d)` like `v`.
        """

    @abc.abstractmethod
    def transpose(self) -> "AbstractJacobian":
        """The transposes (not conjugated: JAX's cotangents are transposes).

        **Returns:**

        The operator of `J_k^T`, the same structure.
        """

    @abc.abstractmethod
    def coefficients(self) -> Array:
        """The operator as coefficients of a linear recurrence over the chunks.

        **Returns:**

        `pscan.linear_recurrence`'s `a`: `(K, d, d)` (dense) or `(K, d)` (diagonal).
        """

    @abc.abstractmethod
    def rows(self, keep: Array) -> "AbstractJacobian":
        """Masks whole chunks.

        **Returns:**

        The operator of `J_k` where `keep[k]` (a `(K,)` bool array), zero elsewhere.
        """

    @abc.abstractmethod
    def finite(self) -> Array:
        """Checks the entries.

        **Returns:**

        Per chunk, whether every entry is finite: a `(K,)` bool array.
        """

    def scale(self, factor) -> "AbstractJacobian":
        """Scales every Jacobian.

        **Returns:**

        The operator of `factor * J_k`.
        """
        return jax.tree_util.tree_map(lambda m: factor * m, self)


def _unit_products(f, s, width: int, out_axes):
    """`group(start)`: forward-mode products of `f` at `s` with the unit vectors
    `start, ..., start + width - 1`, vectorised, stacked on `out_axes`; returns
    `(f(s), products)`."""
    d = s.shape[0]
    columns = jax.vmap(lambda e: jax.jvp(f, (s,), (e,)), out_axes=(None, out_axes))

    def group(start):
        eye = jnp.arange(d)[None, :] == start + jnp.arange(width)[:, None]
        basis = eye.astype(s.dtype) + jnp.zeros_like(s)  # typed like `s` in shard_map
        return columns(basis)

    return group


def _in_groups(f, s, width: int, init, write, out_axes=0):
    """Forward-mode products of `f` at `s` with the unit vectors, `width` of them at
    once (vectorised), one group after another: `write(acc, start, columns)` folds
    each group's products (stacked on `out_axes`) into `acc`, from `init(shapes)`
    (`shapes` those of `f`'s output). Running `f` once per group, `ceil(d / width)`
    times, with `width` tangents in flight. Returns `(acc, f(s))`: the value comes
    with every group's products."""
    d = s.shape[0]
    products = _unit_products(f, s, width, out_axes)

    def group(i, carry):
        start = group_start(i, width, d)
        value, columns = products(start)
        return write(carry[0], start, columns), value

    shapes = jax.eval_shape(f, s)
    # typed like `s` in shard_map (adds zeros)
    like = lambda out: jnp.zeros(out.shape, out.dtype) + jnp.zeros_like(s[0], out.dtype)
    value = jax.tree_util.tree_map(like, shapes)
    return lax.fori_loop(0, -(-d // width), group, (init(shapes), value))


def _stacked(f, s, width: int, axis: int):
    """`df/ds` as `_dense` builds it, its column groups stacked by a `lax.map` (each
    group's products written along a new leading axis) and then joined along `axis`
    in one copy. For one-step chunks on a TPU, where writing the groups in place
    along the Jacobians' own axes costs a relayout of all of them per group (their
    minor axis tiled to 128 lanes). Not heavier there (XLA temp of one-step chunks'
    Jacobians on a TPU v5e, T = 65536, d = 32: 256 MiB against 1185 in place), but
    on CPU it would be (312 against 64 MiB). Returns `(jacobian, f(s))`."""
    d = s.shape[0]
    n = -(-d // width)
    products = _unit_products(f, s, width, axis)
    group = lambda i: products(group_start(i, width, d))
    values, groups = lax.map(group, jnp.arange(n))
    repeated = n * width - d  # the last group's first columns, in the one before too

    def join(stack):  # (n, width, *S) if `axis` is 0, else (n, *S, width)
        if axis == 0:
            at, full = 0, stack.reshape(n * width, *stack.shape[2:])
        else:  # one transpose, which XLA makes the stack's own layout: no copy of
            # `(n, *S, width)` padded to 128 lanes when `width` < 128
            at = stack.ndim - 2
            full = jnp.moveaxis(stack, 0, -2).reshape(*stack.shape[1:-1], -1)
        if repeated == 0:
            return full
        head = lax.slice_in_dim(full, 0, (n - 1) * width, axis=at)
        tail = lax.slice_in_dim(stack[-1], repeated, width, axis=at)
        return jnp.concatenate([head, tail], at)

    value = jax.tree_util.tree_map(lambda v: v[0], values)
    return jax.tree_util.tree_map(join, groups), value


def _dense(
    f, s, transposed: bool, groups: int = 8, least: int = 16, stacked: bool = False
):
    """`df/ds` by forward mode, its columns in at most `groups` groups of at least
    `least` columns, one group after another: the tangents in flight at once are
    about `d / groups` vectors, not `d` (the temporary memory of the gradient of a
    wide cell), for the price of running `f` itself once per group. Each group is
    written in place: rows of the transpose if `transposed` (no copy either way);
    or, with `stacked`, stacked and joined in one copy (`_stacked`).
    `f` may return a pytree: then the Jacobian is a pytree like it, each leaf `(*S, d)`
    (`(d, *S)` if `transposed`) for an output leaf of shape `S`. Returns
    `(jacobian, f(s))`."""
    d = s.shape[0]
    width = min(d, max(least, -(-d // groups)))
    if stacked:
        return _stacked(f, s, width, 0 if transposed else -1)

    def write(jac, start, columns):
        axis = lambda j: 0 if transposed else j.ndim - 1
        put = lambda j, c: lax.dynamic_update_slice_in_dim(j, c, start, axis(j))
        return jax.tree_util.tree_map(put, jac, columns)

    def zeros(out):
        shape = (d, *out.shape) if transposed else (*out.shape, d)
        return jnp.zeros(shape, out.dtype) + jnp.zeros_like(s)  # typed like `s`

    init = lambda shapes: jax.tree_util.tree_map(zeros, shapes)
    return _in_groups(f, s, width, init, write, out_axes=0 if transposed else -1)


def _diagonal(f, s, width: int):
    """`diag(df/ds)` by forward-mode products, `width` at a time, keeping one entry
    of each: memory `O(d)` and `width` tangents, never the `d x d` matrix. Returns
    `(diagonal, f(s))`."""
    width = min(s.shape[0], width)

    def write(diag, start, columns):  # row j of `columns` is column `start + j`
        block = lax.dynamic_slice_in_dim(columns, start, width, axis=1)
        return lax.dynamic_update_slice_in_dim(diag, jnp.diagonal(block), start, 0)

    return _in_groups(f, s, width, lambda _: jnp.zeros_like(s), write)


def _aliased(rows: int, starts, xs) -> bool:
    """Whether a forward-mode pass over `rows` chunks in lockstep would read rows of
    state that share cache sets, where `rows + 1` would not: on CPU, for chunks of
    several steps, when the rows' states take a multiple of 2 KiB (GRU 1 -> 32,
    `Newton(chunk_size=128)` forward on one core: 5.3 us a step at K = 127 chunks,
    15.2 at K = 128, 10.8 at 96, 5.5 at 95, 4.3 at 112 (2 KiB), 2.9 at 104 (1 KiB);
    docs/benchmarks.md)."""
    row = starts.shape[-1] * starts.dtype.itemsize
    return (
        jax.default_backend() == "cpu"
        and chunk_length(xs) > 1
        and (rows * row) % _ALIASING_BYTES == 0
        and ((rows + 1) * row) % _ALIASING_BYTES != 0
    )


def _over_chunks(one, starts, xs):
    """`jax.vmap(one)(starts, xs)` over the K chunks, with one more chunk (a copy of
    the last, its outputs dropped) where the K would be `_aliased`."""
    k = starts.shape[0]
    if not _aliased(k, starts, xs):
        return jax.vmap(one)(starts, xs)
    more = lambda x: jnp.concatenate([x, x[-1:]])
    out = jax.vmap(one)(more(starts), jax.tree_util.tree_map(more, xs))
    return jax.tree_util.tree_map(lambda x: x[:k], out)


_ALIASING_BYTES = 2048


class DenseJacobian(AbstractJacobian):
    """Full chunk Jacobians, by forward mode in groups of columns (memory `O(K d^2)`).
    Exact: boundary recurrences with it are solved at once.

    **Attributes:**

    - `matrix`: `(K, d, d)`, `J_k` (or `J_k^T` when built `transposed`).
    """

    matrix: Array
    exact: ClassVar[bool] = True

    @classmethod
    def linearise(cls, f, starts, xs, *, transposed=False, value=False):
        # one-step chunks (DEER) on a TPU: the column groups stacked, not written in
        # place, which there cost a relayout of all T Jacobians per group (GRU 1 -> 32,
        # T = 65536, TPU v5e: DEER's forward 308 -> 82 ms; at d = 128, T = 16384,
        # 561 -> 81 ms). With longer chunks both are level (2 <= C <= 32) or in place
        # wins (C = 128, d = 128: 21 against 25 ms), and on CPU in place wins always
        # (the Jacobians of T = 16384 one-step chunks, d = 32, in 26 against 47 ms)
        stacked = chunk_length(xs) == 1 and jax.default_backend() == "tpu"
        one = lambda s, x: _dense(lambda s: f(s, x), s, transposed, stacked=stacked)
        out, values = _over_chunks(one, starts, xs)
        out = (cls(out[0]), out[1]) if isinstance(out, tuple) else (cls(out),)
        out = (*out, values) if value else out
        return out if len(out) > 1 else out[0]

    def mv(self, v):
        return jnp.einsum("kij,kj->ki", self.matrix, v, precision=lax.Precision.HIGHEST)

    def transpose(self):
        return DenseJacobian(jnp.swapaxes(self.matrix, -1, -2))

    def coefficients(self):
        return self.matrix

    def rows(self, keep):
        return DenseJacobian(jnp.where(keep[:, None, None], self.matrix, 0))

    def finite(self):
        return finite_along(self.matrix, axis=(-2, -1))


class DiagonalJacobian(AbstractJacobian):
    """The diagonals of the chunk Jacobians (quasi-Newton), by forward mode a few
    columns at a time, one entry of each kept: memory `O(K d)`. An approximation: the
    implicit gradient uses it as the preconditioner of an exact iteration.

    **Attributes:**

    - `diagonal`: `(K, d)`, the diagonal of every `J_k`.
    """

    diagonal: Array
    exact: ClassVar[bool] = False

    @classmethod
    def linearise(cls, f, starts, xs, *, transposed=False, value=False):
        # chunks of C >= 8 steps on CPU: `C / 8` products at once (at most 16), about
        # T / 8 tangents in flight (each a state). Shorter chunks (quasi-DEER), and
        # every length on a TPU: 32 products at once over `32 / C` groups of chunks in
        # turn, at most about T tangents: the loop takes `max(32, C) d / 32` steps, not
        # `8 d` as with one product over 8 groups (quasi-DEER's forward 8x faster on
        # a TPU at d = 128, 2.6x on CPU; its gradient's memory level. On a TPU v5e,
        # GRU 1 -> 128, T = 16384, Newton(C, diagonal) forward 2.7x faster at C = 8,
        # 1.5x at C = 128, gradient temp 2 -> 10 MiB at C = 32; on CPU 1.1-2.2x faster
        # too, but its XLA temp 1.4-5x: docs/benchmarks.md)
        del transposed  # a diagonal is its own transpose
        c = chunk_length(xs)
        if c >= 8 and jax.default_backend() != "tpu":
            width, groups = min(16, c // 8), 1
        else:
            width, groups = 32, -(-32 // c)

        one = lambda sx: _diagonal(lambda s: f(s, sx[1]), sx[0], width)
        if groups == 1:
            out, values = _over_chunks(lambda s, x: one((s, x)), starts, xs)
        else:  # groups of one more chunk where theirs would be aliased
            size = -(-starts.shape[0] // groups)
            size += _aliased(size, starts, xs)
            out, values = map_in_groups(one, (starts, xs), groups, size)
        return (cls(out), values) if value else cls(out)

    def mv(self, v):
        return self.diagonal * v

    def transpose(self):
        return self

    def coefficients(self):
        return self.diagonal

    def rows(self, keep):
        return DiagonalJacobian(jnp.where(keep[:, None], self.diagonal, 0))

    def finite(self):
        return finite_along(self.diagonal, axis=-1)


STRUCTURES = {"dense": DenseJacobian, "diagonal": DiagonalJacobian}
"""The Jacobian structure that a solver's `jacobian="dense" | "diagonal"` names."""
