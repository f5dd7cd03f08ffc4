from typing import ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from .._axis import shift_backward, shift_forward
from .._linear import linear_recurrence
from ._base import as_python
from ._shooting import AbstractShootingSolver


def _in_groups(f, s, width: int, init, write, out_axes=0):
    """Forward-mode products of `f` at `s` with the unit vectors, `width` of them at
    once (vectorised), one group after another: `write(acc, start, columns)` folds
    each group's products (stacked on `out_axes`) into `acc`, from `init`. Running `f`
    once per group, `ceil(d / width)` times, with `width` tangents in flight."""
    d = s.shape[0]
    columns = jax.vmap(lambda e: jax.jvp(f, (s,), (e,))[1], out_axes=out_axes)

    def group(i, acc):
        start = jnp.minimum(i * width, d - width)  # the last group may overlap
        eye = jnp.arange(d)[None, :] == start + jnp.arange(width)[:, None]
        basis = eye.astype(s.dtype) + jnp.zeros_like(s)  # typed like `s` in shard_map
        return write(acc, start, columns(basis))

    return lax.fori_loop(0, -(-d // width), group, init)


def _diagonal_jacobian(f, s, width: int):
    """`diag(df/ds)` by forward-mode products, `width` at a time, keeping one entry
    of each: memory `O(d)` and `width` tangents, never the `d x d` matrix."""
    width = min(s.shape[0], width)

    def write(diag, start, columns):  # row j of `columns` is column `start + j`
        block = lax.dynamic_slice_in_dim(columns, start, width, axis=1)
        return lax.dynamic_update_slice_in_dim(diag, jnp.diagonal(block), start, 0)

    return _in_groups(f, s, width, jnp.zeros_like(s), write)


def _dense_jacobian(f, s, transposed: bool, groups: int = 8, least: int = 16):
    """`df/ds` by forward mode, its columns in at most `groups` groups of at least
    `least` columns, one group after another: the tangents in flight at once are
    about `d / groups` vectors, not `d` (the temporary memory of the gradient of a
    wide cell), for the price of running `f` itself once per group. Each group is
    written in place: rows of the transpose if `transposed` (no copy either way).
    `f` may return a pytree: then the Jacobian is a pytree like it, each leaf `(*S, d)`
    (`(d, *S)` if `transposed`) for an output leaf of shape `S`."""
    d = s.shape[0]
    width = min(d, max(least, -(-d // groups)))

    def write(jac, start, columns):
        axis = lambda j: 0 if transposed else j.ndim - 1
        put = lambda j, c: lax.dynamic_update_slice_in_dim(j, c, start, axis(j))
        return jax.tree_util.tree_map(put, jac, columns)

    def zeros(out):
        shape = (d, *out.shape) if transposed else (*out.shape, d)
        return jnp.zeros(shape, out.dtype) + jnp.zeros_like(s)  # typed like `s`

    init = jax.tree_util.tree_map(zeros, jax.eval_shape(f, s))
    return _in_groups(f, s, width, init, write, out_axes=0 if transposed else -1)


class Newton(AbstractShootingSolver):
    """Newton's method on the chunk-start states (multiple shooting); DEER when
    `chunk_size=1`.

    The unknowns are the states `s[k]` at the start of each chunk; `F_k(s)` runs chunk
    `k` exactly from `s`. A Newton step linearises every `F_k` at once,
    `s[k+1] <- F_k(s[k]) + A_k (s_new[k] - s[k])` with `A_k = (1 - damping) J_k`, and
    solves that linear recurrence over the K chunks with `pscan.linear_recurrence`.
    Iteration `n` makes the first `n` chunks exact, so `ceil(T / chunk_size)`
    iterations always reach the sequential answer.

    - `chunk_size=1, jacobian="dense"` is DEER (Lim et al. 2024): memory `O(T d^2)`.
    - `jacobian="diagonal"` is quasi-Newton (quasi-DEER, Gonzalez et al. 2024): only
        the diagonal of `J_k`, by forward mode, memory `O(K d)` (the implicit gradient
        uses it too, to precondition its own iteration); more iterations. Its
        forward-mode products run `chunk_size / 8` (at most 16) at a time: about
        `T / 8` tangent states in flight.
    - `chunk_size > 1`: Jacobians of whole chunks, memory `O(K d^2)` with
        `K = T / chunk_size`; few iterations for contractive cells.

    Whatever the Jacobian used forward, the gradient is exact and implicit (see
    `pscan.recurrence`). A non-finite Newton step is replaced by a Picard sweep from
    the last finite guess; finite iterates that run away are held at +-sqrt(largest
    float) (a start held there never counts as converged).

    **Arguments:**

    - `chunk_size`: steps per chunk (`1`: every step is an unknown, as in DEER).
    - `jacobian`: `"dense"` or `"diagonal"`.
    - `damping`: `k` in `[0, 1)`; the step uses `(1 - k) J`, which stabilises
        iterations on stiff or chaotic cells at the price of more of them.
    - `max_iters`: the most iterations.
    - `rtol`, `atol`: converged when every chunk start changed by at most
        `atol + rtol * |s|` in the last iteration.
    - `fallback`: `None`, or `"sequential"` to return the exact sequential solution
        (and flag `stats["fell_back"]`) when not converged.
    - `axis_name`: inside `shard_map`, the mesh axis that splits time (each device
        holds a block of consecutive steps, a multiple of `chunk_size`); boundary
        states cross devices once per iteration. See `pscan.sharded_recurrence`.
    """

    chunk_size: int = eqx.field(static=True, default=1, converter=as_python)
    jacobian: str = eqx.field(static=True, default="dense")
    damping: float = eqx.field(static=True, default=0.0, converter=as_python)
    max_iters: int = eqx.field(static=True, default=100, converter=as_python)
    rtol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    atol: float = eqx.field(static=True, default=1e-6, converter=as_python)
    fallback: str | None = eqx.field(static=True, default=None)
    axis_name: str | None = eqx.field(static=True, default=None)
    name: ClassVar[str] = "Newton"

    def __check_init__(self):
        if self.jacobian not in ("dense", "diagonal"):
            raise ValueError(
                f"pscan.Newton: `jacobian` must be 'dense' or 'diagonal', got {self.jacobian!r}"
            )
        d = self.damping
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
            raise ValueError(f"pscan.Newton: `damping` must be in [0, 1), got {d!r}")

    @property
    def _jacobian(self):
        return self.jacobian

    def _linearise(self, chunk_end, starts, xs, transposed=False):
        if self.jacobian == "dense":
            dense = lambda s, x: _dense_jacobian(
                lambda s: chunk_end(s, x), s, transposed
            )
            return jax.vmap(dense)(starts, xs)
        # about T / 8 tangents in flight (each a state): `C / 8` products at once for
        # chunks of C >= 8 steps (at most 16); for shorter chunks one product at a
        # time over `8 / C` groups of chunks in turn
        c = self.chunk_size
        width = min(16, max(1, c // 8))
        diagonal = lambda sx: _diagonal_jacobian(
            lambda s: chunk_end(s, sx[1]), sx[0], width
        )
        groups = -(-8 // c)
        if groups == 1:
            return jax.vmap(diagonal)((starts, xs))
        return lax.map(diagonal, (starts, xs), batch_size=-(-starts.shape[0] // groups))

    def _update(self, chunk_end, starts, xs, h0):
        ends = jax.vmap(chunk_end)(starts, xs)
        # every chunk's linearisation but the last one's (across devices, the last
        # chunk of a device feeds the next device)
        sharded = self.axis_name is not None
        lin_starts = starts if sharded else starts[:-1]
        lin_xs = xs if sharded else _head(xs)
        lin_ends = ends if sharded else ends[:-1]
        jac = self._linearise(chunk_end, lin_starts, lin_xs)
        if self.jacobian == "dense":
            apply = lambda a, s: jnp.einsum(
                "kij,kj->ki", a, s, precision=lax.Precision.HIGHEST
            )
        else:
            apply = lambda a, s: a * s
        a = (1 - self.damping) * jac
        # A chunk with a non-finite end or Jacobian (after a non-finite input) must not
        # spread NaN through the linear solve to every later chunk: its start is
        # taken as it is (a zero Jacobian, the next start as its end), and its end
        # is marked non-finite again afterwards for `_iterate` to hold
        end_ok = jnp.all(jnp.isfinite(lin_ends), axis=-1)
        ok = end_ok & jnp.all(jnp.isfinite(a), axis=tuple(range(1, a.ndim)))
        rows = lambda m, x: m.reshape(m.shape + (1,) * (x.ndim - 1))
        a = jnp.where(rows(ok, a), a, 0)
        following = shift_backward(starts, self.axis_name) if sharded else starts[1:]
        b = jnp.where(
            rows(ok, lin_ends),
            lin_ends - apply(a, lin_starts),
            jnp.where(rows(end_ok, lin_ends), lin_ends, following),
        )
        if sharded:
            after = linear_recurrence(a, b, h0, axis_name=self.axis_name)
        else:
            after = linear_recurrence(a, b, h0)
        after = jnp.where(rows(end_ok, after), after, jnp.nan)
        if sharded:
            return shift_forward(after, h0, self.axis_name)
        return jnp.concatenate([h0[None], after])


def _head(xs):
    return jax.tree_util.tree_map(lambda x: x[:-1], xs)
