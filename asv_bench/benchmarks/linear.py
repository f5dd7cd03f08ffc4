"""`pscan.linear_recurrence`: every method against a plain `lax.scan` (the in-suite
baseline, method "lax.scan"), forward and gradient with respect to `(a, b)`."""

from .measure import TABLES, compile_timed, peak_rss_of, run, sizes
from .scenarios import LINEAR_METHODS, linear_problem, linear_programs


class LinearRecurrence:
    params = (LINEAR_METHODS, sizes([2**14, 2**17, 2**19], [2**10]), [1, 32])
    param_names = ["method", "length", "channels"]
    timeout = 600
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, method, length, channels):
        self.a, self.b = linear_problem(length, channels)
        programs = linear_programs(method)
        self.forward, self.forward_compile = compile_timed(
            programs["fwd"], self.a, self.b
        )
        self.gradient, self.gradient_compile = compile_timed(
            programs["grad"], self.a, self.b
        )

    def time_forward(self, *_):
        run(self.forward, self.a, self.b)

    def time_gradient(self, *_):
        run(self.gradient, self.a, self.b)

    def track_peak_rss_gradient(self, method, length, channels):
        """Peak RSS while the compiled gradient runs (inputs and outputs included),
        in a fresh process whose high-water mark is reset after compiling: not the
        compiler's memory, nor this process's other programs."""
        argv = ["linear", "--length", str(length), "--state", str(channels)]
        return peak_rss_of(TABLES, *argv, "--child", f"{method}/grad")

    def track_compile_forward(self, *_):
        return self.forward_compile

    def track_compile_gradient(self, *_):
        return self.gradient_compile

    track_peak_rss_gradient.unit = "MiB"
    track_compile_forward.unit = "seconds"
    track_compile_gradient.unit = "seconds"
