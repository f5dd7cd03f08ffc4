"""`pscan.recurrence` on a GRU cell (1 -> 32): every solver's forward, gradient and
iteration count; `Sequential` is a plain `lax.scan`. The iterations the solvers need
on chaotic cells. And a batch of series of different lengths, packed or padded."""

import equinox as eqx
import jax

import pscan

from .measure import compile_timed, run, sizes, temp_mib
from .scenarios import (
    AR_GRU_CONFIGS,
    MILD_AR_GRU_CONFIG,
    ar_gru_problem,
    cell_residual,
    chaos_solvers,
    gru_problem,
    gru_solvers,
    packed_problem,
    packed_programs,
    solver_programs,
)

SOLVERS = gru_solvers(chunk=256)
# the two strongly chaotic AR-GRUs and the milder one, as in `tables.py chaos`
CHAOTIC = {str(c[:3]): c for c in [*AR_GRU_CONFIGS, MILD_AR_GRU_CONFIG]}


class GRUSolvers:
    # 2**16 - 1: a length that is not a multiple of the chunk size, as users' are
    # (the last chunk padded: one more copy of the states forward and in the gradient)
    params = (list(SOLVERS), sizes([2**12, 2**16, 2**16 - 1], [2**9]))
    param_names = ["solver", "length"]
    timeout = 600
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, solver, length):
        self.cell, self.xs, h0 = gru_problem(length)
        programs = solver_programs(SOLVERS[solver], h0)
        self.forward, self.forward_compile = compile_timed(
            programs["fwd"], self.cell, self.xs
        )
        self.gradient, self.gradient_compile = compile_timed(
            programs["grad"], self.cell, self.xs
        )
        sol = jax.jit(programs["solve"])(self.cell, self.xs)
        self.iterations = int(sol.stats["num_iterations"])

    def time_forward(self, *_):
        run(self.forward, self.cell, self.xs)

    def time_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def track_iterations(self, *_):
        return self.iterations

    def track_compile_gradient(self, *_):
        return self.gradient_compile

    def track_gradient_temp(self, *_):
        return temp_mib(self.gradient)

    track_iterations.unit = "iterations"
    track_compile_gradient.unit = "seconds"
    track_gradient_temp.unit = "MiB"


class ChaoticCells:
    """The chaotic autoregressive GRUs of `tables.py chaos` (T = 2000): iterations to
    converge (`max_iters = T + 1` means it did not), the residual of the answer, and
    in how many iterations an iterate ran away to the float bound."""

    params = (
        list(chaos_solvers(1, 1e-5)),
        list(CHAOTIC),
        sizes([2000], [48]),
    )
    param_names = ["solver", "cell", "length"]
    timeout = 600

    def setup(self, solver, cell, length):
        cell, xs, h0 = ar_gru_problem(length, *CHAOTIC[cell])
        solve = eqx.filter_jit(pscan.recurrence)
        sol = solve(
            cell, xs, h0, solver=chaos_solvers(length, 1e-5)[solver], throw=False
        )
        self.iterations = int(sol.stats["num_iterations"])
        self.residual = cell_residual(cell, xs, h0, sol.hs)
        self.at_bound = int(sol.stats["num_at_bound"])

    def track_iterations(self, *_):
        return self.iterations

    def track_residual(self, *_):
        return self.residual

    def track_at_bound(self, *_):
        return self.at_bound

    track_iterations.unit = "iterations"
    track_residual.unit = "max |h[t] - cell(x[t], h[t-1])|"
    track_at_bound.unit = "iterations"


PACKED_SOLVERS = {
    "Sequential()": pscan.Sequential(),
    "Newton(chunk_size=128)": pscan.Newton(chunk_size=128, rtol=1e-5, atol=1e-5),
}


class PackedSeries:
    """16 GRU series of different lengths (`tables.py packed`): packed with `resets`,
    one by one, or right-padded under `vmap` with `length`."""

    params = (
        list(PACKED_SOLVERS),
        ["packed (resets)", "one by one", "padded (vmap, length)"],
        sizes([2**19], [2**9]),
    )
    param_names = ["solver", "way", "total"]
    timeout = 900
    number = 1
    repeat = (2, 5, 120.0)

    def setup(self, solver, way, total):
        shortest = 1000 if total >= 2**16 else 4
        self.cell, self.xs, h0, lengths = packed_problem(total, shortest=shortest)
        programs = packed_programs(PACKED_SOLVERS[solver], h0, lengths)[way]
        self.gradient, _ = compile_timed(programs["grad"], self.cell, self.xs)
        sol = jax.jit(programs["solve"])(self.cell, self.xs)
        self.iterations = int(sol.stats["num_iterations"])

    def time_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def track_iterations(self, *_):
        return self.iterations

    def track_gradient_temp(self, *_):
        return temp_mib(self.gradient)

    track_iterations.unit = "iterations"
    track_gradient_temp.unit = "MiB"
