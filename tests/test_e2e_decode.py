"""benchmarks/e2e_decode.py, the GPU check's end-to-end stage, run at test size on CPU: it generates the random
checkpoint, builds the runner, decodes every case and prices it against a (given) HBM peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "e2e_decode.py"


@pytest.mark.slow
def test_tiny_deepseek_run_times_every_case_against_the_roofline(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--model", "deepseek-v2-lite", "--tiny", "--batches", "1", "4",
           "--inputs", "40", "--steps", "2", "--peak-tbs", "0.05", "--work", str(tmp_path),
           "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "e2e_deepseek-v2-lite.json").read_text())
    assert report["greedy_graphs_equal_eager"] is True and report["graph_sizes"] == []  # CPU: eager only
    cases = report["cases"]
    assert [(c["batch"], c["input"], c["mode"]) for c in cases] == [(1, 40, "eager"), (4, 40, "eager")]
    assert all(c["tok_s"] > 0 and c["roofline_ms"] > 0 and c["fraction"] > 0 for c in cases)
    # a bigger batch reaches more experts and more KV: more bytes, so a longer roofline step
    assert cases[1]["roofline_ms"] > cases[0]["roofline_ms"]
    assert [r["tokens"] for r in report["moe"]] == [1, 8, 64]
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]  # the generated checkpoint is gone
