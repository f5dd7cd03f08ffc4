import gc
import os

import jax
import pytest

# References are float64; float32 cases ask for float32 explicitly. The x64-off path is
# covered in a subprocess (tests/test_linear.py::test_x64_disabled).
jax.config.update("jax_enable_x64", True)
# Test sizes are tiny, so compiling is most of the suite's time: compile fast (the
# benchmarks measure the optimised programs; test_examples.py runs scripts likewise).
# `PSCAN_TEST_OPTIMISED=1` runs the suite on XLA's optimised programs, as users run
# them: 1.5x the time (2026-12-07: everything but test_examples.py and
# test_sharding.py, 733 tests, passed in 15 min on 2 cores against 10).
if os.environ.get("PSCAN_TEST_OPTIMISED", "0") != "1":
    jax.config.update("jax_disable_most_optimizations", True)

# Every compiled XLA:CPU program keeps a few memory mappings of its machine code for as
# long as JAX caches it, and a test process compiles thousands of programs: the
# workers of `pytest -n 2` neared Linux's limit of mappings per process
# (`vm.max_map_count`, 65530 by default; one process running test_recurrence.py,
# test_segments.py and test_nn.py ended at 59,873), and twice a compile late in the run
# segfaulted. Past a third of the limit, the cached programs are released.
_MAX_MAPPINGS = 20_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    yield
    if _mappings() > _MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def traced_as(monkeypatch):
    """`traced_as(name)`: from then on programs are traced as for the backend `name`
    (`jax.default_backend()` says so), and none traced before is reused, nor one
    traced here afterwards (pscan's solves are compiled once for a configuration,
    and the backend they were traced for is not part of it)."""

    def patch(name: str):
        jax.clear_caches()
        monkeypatch.setattr(jax, "default_backend", lambda: name)

    yield patch
    jax.clear_caches()
