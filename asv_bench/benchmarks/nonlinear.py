"""`pscan.recurrence` on a GRU cell (1 -> 32): every solver's forward, gradient and
iteration count; `Sequential` is a plain `lax.scan`."""

import jax

from .measure import compile_timed, run, sizes, temp_mib
from .scenarios import gru_problem, gru_solvers, solver_programs

SOLVERS = gru_solvers(chunk=256)


class GRUSolvers:
    params = (list(SOLVERS), sizes([2**12, 2**16], [2**9]))
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

    def peakmem_gradient(self, *_):
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
