"""The seed scenario: an Elman network 32 -> 32 over a batch of 16 sequences, gradient
of the sum of all outputs with respect to the parameters; `pscan.nn.Recurrence` with its
default solver against a hand-written `lax.scan` of the same cell."""

from .measure import TABLES, compile_timed, peak_rss_of, run, sizes
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

    def track_peak_rss_gradient(self, program, length):
        """Peak RSS while the compiled gradient runs, in a fresh process (see
        `linear.LinearRecurrence.track_peak_rss_gradient`)."""
        argv = ["seed", "--length", str(length), "--child", program]
        return peak_rss_of(TABLES, *argv)

    def track_compile_gradient(self, *_):
        return self.compile

    track_peak_rss_gradient.unit = "MiB"
    track_compile_gradient.unit = "seconds"
