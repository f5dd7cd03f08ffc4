"""The outcome of `pscan.recurrence`: states, a result code and statistics."""

from typing import Any

import equinox as eqx
from jaxtyping import Array, PyTree


class RESULTS(eqx.Enumeration):
    """How a solve ended. Compare with `==`, e.g. `sol.result == pscan.RESULTS.successful`."""

    successful = ""
    max_iters_reached = (
        "The solver did not converge within `max_iters` iterations. Raise `max_iters` "
        "(`T / chunk_size` iterations are always enough), loosen `rtol`/`atol`, try "
        "`damping`, or pass `fallback='sequential'`."
    )
    nonfinite = (
        "The cell produced non-finite states (NaN or inf) from finite inputs: the "
        "recurrence itself diverges, or its inputs or parameters are non-finite."
    )


class Solution(eqx.Module):
    """The states of a recurrence and how they were found.

    **Attributes:**

    - `hs`: a pytree like `h0` with a leading time axis: `hs[t]` is the state after
        step `t`.
    - `result`: a `pscan.RESULTS` code.
    - `stats`: a dict with `num_iterations` (parallel sweeps; `0` for `Sequential`),
        `max_residual` (the largest change of a chunk-start state in the last sweep,
        relative to the tolerance scale: `<= 1` means converged) and `fell_back`
        (whether the exact sequential fallback produced `hs`).
    """

    hs: PyTree[Array]
    result: RESULTS
    stats: dict[str, Any]

