"""benchmarks/vs_vllm.py's driver: no process of a system outlives its run, the vLLM column is skipped with a
reason when there is no vLLM venv, and the table's ratios (the measured runs themselves are in
docs/results/vs-vllm-cpu.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_vllm.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vs_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_systems_whole_process_group_is_ended(bench):
    """vLLM leaves engine and worker processes behind its main one; ending the group leaves none of them."""
    proc = subprocess.Popen(
        ["bash", "-c", "trap '' TERM; sleep 300 & sleep 300 & wait"],  # ignores SIGTERM: SIGKILL must follow
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while len(bench._group_members(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(bench._group_members(proc.pid)) == 3  # bash and its two children
        bench.end_group(proc.pid, grace_s=1.0)
        assert bench._group_members(proc.pid) == []
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_no_vllm_venv_skips_the_column_with_the_reason(bench, tmp_path):
    assert bench.vllm_python(None) == (None, "no --vllm-venv given")
    assert bench.vllm_python(str(tmp_path)) == (None, f"{tmp_path / 'bin' / 'python'} not found")


def test_table_ratios_and_missing_cells(bench):
    best = {("dcpctl", "float32", 1): 30.0, ("vllm", "float32", 1): 12.0, ("hf", "float32", 1): 10.0}
    best[("dcpctl", "float32", 16)] = 200.0
    lines = bench.table(best, ["float32"], [1, 16], ["dcpctl", "vllm", "hf"]).splitlines()
    assert lines[2] == "| float32 | 1 | 30.0 | 12.0 | 10.0 | 2.50x | 3.00x |"
    assert lines[3] == "| float32 | 16 | 200.0 | failed | failed | - | - |"
    without_vllm = bench.table(best, ["float32"], [1], ["dcpctl", "hf"]).splitlines()
    assert without_vllm[2] == "| float32 | 1 | 30.0 | - | 10.0 | - | 3.00x |"
