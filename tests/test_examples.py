"""The example and benchmark scripts run end to end at tiny sizes (the linear table's
peak-RSS child processes included)."""

import os
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
            "examples/seed_scaling.py",
            ["--max-length", "400", "--naive-limit", "0.001", "--plot", "TMP/s.png"],
            "| 400 | pscan |",
        ),
        (
            "examples/train_long_series.py",
            [
                "--length",
                "3000",
                "--steps",
                "3",
                "--eval-every",
                "2",
                "--hidden",
                "8",
                "--out-dir",
                "TMP/",
            ],
            "validation loss",
        ),
        (
            "examples/train_long_series.py",
            [
                "--length",
                "500",
                "--steps",
                "2",
                "--model",
                "gru",
                "--solver",
                "newton",
                "--hidden",
                "4",
                "--depth",
                "1",
                "--horizon",
                "5",
                "--out-dir",
                "TMP/",
            ],
            "validation loss",
        ),
        (
            "examples/train_long_series.py",
            [
                "--length",
                "2000",
                "--packed",
                "4",
                "--steps",
                "2",
                "--model",
                "mingru",
                "--hidden",
                "4",
                "--depth",
                "1",
                "--forecast",
                "30",
                "--out-dir",
                "TMP/",
            ],
            "free-running forecast of",
        ),
        (
            "asv_bench/gpu_check.py",
            [
                "--length",
                "256",
                "--batch",
                "2",
                "--hidden",
                "3",
                "--gru-length",
                "64",
                "--chunk",
                "8",
                "--repeats",
                "1",
            ],
            "of copy bandwidth",
        ),
        (
            "asv_bench/block_products.py",
            ["--length", "64", "--repeats", "1", "--as-tpu"],
            "| dense linear_recurrence, T = 64, gradient | ",
        ),
        (
            "asv_bench/tables.py",
            [
                "linear",
                "--length",
                "100",
                "--repeats",
                "1",
                "--methods",
                "chunked",
                "--no-memory",
            ],
            "| chunked | grad |",
        ),
        (
            "asv_bench/tables.py",
            [
                "solvers",
                "--length",
                "64",
                "--hidden",
                "4",
                "--chunk",
                "8",
                "--repeats",
                "1",
                "--skip",
                "DEER,diagonal,Picard,checkpoint",
            ],
            "| Newton(chunk_size=8) | ",
        ),
        (
            "asv_bench/tables.py",
            [
                "seed",
                "--length",
                "64",
                "--batch",
                "2",
                "--hidden",
                "4",
                "--every",
                "8",
                "--repeats",
                "1",
            ],
            "Sequential(checkpoint=8)",
        ),
        (
            "asv_bench/tables.py",
            [
                "warmstart",
                "--length",
                "64",
                "--hidden",
                "4",
                "--chunk",
                "8",
                "--repeats",
                "1",
            ],
            "| Newton(chunk_size=8) | ",
        ),
        (
            "asv_bench/tables.py",
            ["sharding", "--length", "64", "--repeats", "1", "--devices", "1,2"],
            "| 2 | ",
        ),
        (
            "asv_bench/tables.py",
            ["deer", "--length", "64", "--hidden", "4", "--repeats", "1"],
            "| pscan Newton(chunk_size=1) | ",
        ),
        (
            "asv_bench/tables.py",
            ["gradmem", "--sizes", "64x4", "--chunk", "8"],
            "| 64 | 4 | Newton(diagonal) = quasi-DEER | ",
        ),
        (
            "asv_bench/tables.py",
            ["packed", "--length", "200", "--count", "2", "--hidden", "3"]
            + ["--chunk", "8", "--repeats", "1"],
            "| Newton(chunk_size=8) | same steps, no resets |",
        ),
        (
            "asv_bench/tables.py",
            ["precision", "--length", "24", "--gru-length", "64", "--chunk", "8"]
            + ["--repeats", "1", "--skip", "DEER,diagonal,damping,ELK"],
            "| Newton(chunk_size=8) | default | ",
        ),
        (
            "asv_bench/tables.py",
            ["eager", "--length", "32", "--hidden", "3", "--chunk", "8"]
            + ["--repeats", "2"],
            "| recurrence, Newton(chunk_size=8) | ",
        ),
        (
            "asv_bench/tables.py",
            ["chaos", "--length", "48", "--cells", "2,mild"],
            "| AR-GRU (16, 5.0, 5.0) | Newton(chunk_size=16) | True | ",
        ),
    ],
)
def test_script_runs(script, args, expect, tmp_path):
    args = [str(tmp_path / a[4:]) if a.startswith("TMP/") else a for a in args]
    out = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=False,
        # tiny sizes: compiling is most of the time, so compile for speed of compiling
        env={**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout
