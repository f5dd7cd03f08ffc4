"""Matrix precision while a solver solves: the cell's residuals at the solver's
`precision`, its Jacobians (forward-mode passes) at a `jacobian_precision` of their own.

On a TPU (or a GPU that multiplies float32 in TF32) a product at the default precision
is rounded to about three digits. The chunk ends decide the fixed point, and their
products run at full precision; a Newton step only needs an approximate Jacobian
(iteration `n` still makes the first `n` chunks exact, and the fixed point is that of
the exact ends), so the forward-mode pass that builds it may run at the default
precision: on a TPU v5e, the same iterations on a mildly chaotic cell and 1.5x the
speed of `Newton(chunk_size=128)` (see docs/benchmarks.md).

A cell's products take the precision it is traced under. Modules and functions that
close over nothing are traced afresh inside `linearising`; a function that closes over
arrays is closure-converted once per precision (`TwoPrecisionCell`).
"""

import contextlib
import contextvars
from collections.abc import Callable

import equinox as eqx
import jax

# True while the Jacobians are being traced (inside `linearising`)
_LINEARISING = contextvars.ContextVar("pscan_linearising", default=False)


def check_precision(owner: str, value, name: str = "precision"):
    """Raises a `ValueError` naming `owner.name` unless `value` is None or a value of
    `jax.default_matmul_precision`."""
    if value is None:
        return
    try:
        with jax.default_matmul_precision(value):
            pass
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"pscan.{owner}: `{name}` must be None or a value of "
            f"`jax.default_matmul_precision` ('highest', 'float32', 'default', ...), "
            f"got {value!r}"
        ) from e


def separate_jacobian_precision(
    precision: str | None, jacobian_precision: str | None
) -> str | None:
    """The precision at which a solver's Jacobians are traced apart from its chunk
    ends, or None: traced with them, in one forward-mode pass (when either is None,
    when they agree, or on CPU, where every product is exact whatever its precision:
    a second pass would only cost)."""
    if precision is None or jacobian_precision in (None, precision):
        return None
    return None if _products_exact() else jacobian_precision


def _products_exact() -> bool:
    """Whether float32 products are exact whatever their precision (CPU)."""
    return jax.default_backend() == "cpu"


@contextlib.contextmanager
def linearising(precision: str):
    """Traces the cell's Jacobians: its products at `precision`, and a
    `TwoPrecisionCell` takes its Jacobian copy."""
    token = _LINEARISING.set(True)
    try:
        with jax.default_matmul_precision(precision):
            yield
    finally:
        _LINEARISING.reset(token)


class TwoPrecisionCell(eqx.Module):
    """A function cell closure-converted twice: `main` at the solver's precision,
    `jacobian` at its Jacobians' (traced inside `linearising`). Both hold the same
    closed-over arrays; only `main` is ever differentiated (the fixed point does not
    depend on the Jacobians a solver steps with)."""

    main: Callable
    jacobian: Callable

    def __call__(self, x, h):
        return (self.jacobian if _LINEARISING.get() else self.main)(x, h)
