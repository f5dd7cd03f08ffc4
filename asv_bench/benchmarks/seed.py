"""The seed scenario: an Elman network 32 -> 32 over a batch of 16 sequences, gradient
of the sum of all outputs with respect to the parameters; `pscan.nn.Recurrence` with its
default solver against a hand-written `lax.scan` of the same cell."""

from .measure import compile_timed, run, sizes
from .scenarios import elman_problem, seed_programs

PROGRAMS = seed_programs()


class SeedScenario:
    params = (list(PROGRAMS), sizes([2**12, 2**15, 2**17, 2**19], [2**8]))
    param_names = ["program", "length"]
    timeout = 900
    number = 1
    repeat = (1, 5, 60.0)

    def setup(self, program, length):
        self.cell, self.xs = elman_problem(length)
        self.gradient, self.compile = compile_timed(
            PROGRAMS[program], self.cell, self.xs
        )

    def time_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def peakmem_gradient(self, *_):
        run(self.gradient, self.cell, self.xs)

    def track_compile_gradient(self, *_):
        return self.compile

    track_compile_gradient.unit = "seconds"
