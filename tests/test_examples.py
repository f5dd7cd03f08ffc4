"""The example and benchmark scripts run end to end at tiny sizes."""

import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize(
    "script, args, expect",
    [
        ("examples/linear_500k.py", ["--length", "300", "--steps", "2"], "loss"),
        (
            "benchmarks/linear.py",
            ["--length", "100", "--repeats", "1", "--methods", "chunked", "--no-memory"],
            "| chunked | grad |",
        ),
        (
            "benchmarks/nonlinear.py",
            ["solvers", "--length", "64", "--hidden", "4", "--chunk", "8", "--repeats", "1",
             "--skip", "DEER,diagonal,Picard"],
            "| Newton(chunk_size=8) | ",
        ),
        (
            "benchmarks/nonlinear.py",
            ["checkpoint", "--length", "64", "--batch", "2", "--hidden", "4", "--every", "8",
             "--repeats", "1"],
            "Sequential(checkpoint=8)",
        ),
    ],
)
def test_script_runs(script, args, expect):
    out = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout
