"""benchmarks/attention_bench.py, the GPU check's bandwidth stage, run tiny on CPU (Triton interpreter): it must
keep up with the attention metadata it builds, and every backend must agree with the torch reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "attention_bench.py"


@pytest.mark.slow
def test_tiny_bandwidth_run_measures_every_backend_without_a_mismatch(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--contexts", "64", "--batches", "1",
           "--reps", "1", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "attention_bench.json").read_text())
    measured = {(r["model"], r["backend"], r["shard"]) for r in rows if r["time_us"]}
    models = {r["model"] for r in rows}
    assert measured == {(m, b, s) for m in models for b in ("triton", "torch") for s in (1, 2)}
    assert not [r for r in rows if "MISMATCH" in r["note"]]


@pytest.mark.slow
def test_tiny_tile_sweep_prints_a_row_per_config(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--contexts", "64", "--batches", "1",
           "--reps", "1", "--sweep"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isalpha()]
    timed = [r for r in rows[1:] if r.split("|")[8].strip().replace(".", "").isdigit()]
    assert len(timed) == len(rows) - 1 >= 2, done.stdout
