"""Sequence parallelism over 4 forced host devices, in a subprocess (the device count is
fixed when JAX starts)."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import pscan


@pytest.mark.parametrize("part", ["linear", "nonlinear", "elk", "segmented"])
def test_sharded_equals_single_device(part):
    script = pathlib.Path(__file__).parent / "sharded_checks.py"
    out = subprocess.run(
        [sys.executable, str(script), part],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},  # as conftest.py
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "OK" in out.stdout


def test_one_device_mesh_and_bad_axis():
    mesh = Mesh(np.array(jax.devices()[:1]), ("time",))
    b = np.ones((5, 2))
    hs = pscan.sharded_linear_recurrence(0.5, b, mesh=mesh, axis_name="time")
    np.testing.assert_allclose(hs, pscan.linear_recurrence(0.5, b))
    with pytest.raises(ValueError, match="'batch' is not an axis"):
        pscan.sharded_linear_recurrence(0.5, b, mesh=mesh, axis_name="batch")
    with pytest.raises(
        ValueError, match="`mesh` must be a jax.sharding.Mesh, got None"
    ):
        pscan.sharded_linear_recurrence(0.5, b, mesh=None, axis_name="time")


def test_sharded_recurrence_bad_input():
    mesh = Mesh(np.array(jax.devices()[:1]), ("time",))
    sharded = lambda solver, **kwargs: pscan.sharded_recurrence(
        lambda x, h: h,
        np.ones((4, 1)),
        np.zeros(1),
        solver=solver,
        mesh=mesh,
        axis_name="time",
        **kwargs,
    )
    with pytest.raises(ValueError, match=r"parallel in time.*Sequential\("):
        sharded(pscan.Sequential())
    with pytest.raises(ValueError, match="cannot be combined with `axis_name`"):
        pscan.Newton(fallback="sequential", axis_name="time")
    with pytest.raises(ValueError, match=r"sharded_recurrence: `throw` must be True"):
        sharded(pscan.Newton(), throw=0)
    with pytest.raises(ValueError, match=r"linear_recurrence: `reverse` must be True"):
        pscan.sharded_linear_recurrence(
            np.ones(4), np.ones(4), mesh=mesh, axis_name="time", reverse="False"
        )
