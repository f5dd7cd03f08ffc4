"""The outcome of `pscan.recurrence`: states, a result code and statistics."""

from typing import Any

import equinox as eqx
from jaxtyping import Array, PyTree


class RESULTS(eqx.Enumeration):
    """How a solve ended. Compare with `==`, e.g. `sol.result == pscan.RESULTS.successful`."""

    successful = ""
    max_iters_reached = (
        "pscan: the solver did not converge within `max_iters` iterations: its last "
        "iteration still moved a chunk-start state by more than `atol + rtol * |s|`. "
        "Raise `max_iters` (`ceil(T / chunk_size)` iterations always suffice), loosen "
        "`rtol`/`atol`, give `Newton` some `damping`, pass `fallback='sequential'`, or "
        "pass `throw=False` and read `sol.stats['max_residual']` (<= 1 means "
        "converged)."
    )
    nonfinite = (
        "pscan: the states are non-finite (NaN or inf) from some step on, as those of "
        "the sequential loop are: a non-finite input, parameter or initial state, or a "
        "cell that blows up. The states before it are exact."
    )


class Solution(eqx.Module):
    """The states of a recurrence and how they were found.

    **Attributes:**

    - `hs`: a pytree like `h0` with a leading time axis: `hs[t]` is the state after
        step `t`.
    - `result`: a `pscan.RESULTS` code.
    - `stats`: a dict with `num_iterations` (parallel sweeps; `0` for `Sequential`),
        `max_residual` (the largest change of a chunk-start state in the last sweep,
        relative to the tolerance scale: `<= 1` means converged; `inf` when the states
        are not all finite), `fell_back` (whether the exact sequential fallback
        produced `hs`) and `num_at_bound` (in how many sweeps an iterate ran away and
        was held at +-sqrt(largest float), as Newton's do on chaotic cells); a solver
        may add its own (`pscan.ELK`: `radius`, the trust radius it ended at).
    """

    hs: PyTree[Array]
    result: RESULTS
    stats: dict[str, Any]
