"""The OpenMP wait policy the engine sets before torch loads (a ~100 µs spin, then sleep) unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "import os, engine, torch; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, ["PASSIVE", "10000"]), ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"}, ["ACTIVE", "5"])],
)
def test_import_engine_sets_the_wait_policy_unless_given(given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | given
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == expected


def test_engine_import_sets_it_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: `import engine` must not load torch first."""
    probe = "import sys, engine; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


def test_bound_openmp_threads_still_get_every_core():
    """GOMP_CPU_AFFINITY pins the main thread to one core when torch loads: the engine's thread count comes from the
    process's cores as they were at `import engine`, not from that pinned thread."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    env = dict(os.environ, GOMP_CPU_AFFINITY=",".join(map(str, cores)))
    probe = "import os, engine, torch; from engine import devices; torch.ones(2).sum(); "
    probe += "print(len(os.sched_getaffinity(0)), devices.cpu_cores())"
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    pinned, counted = map(int, result.stdout.split())
    assert (pinned, counted) == (1, len(cores))
