"""benchmarks/prefill_steps.py on a tiny model: it runs the plan and lists every step's chunks, the chunked ones
with their cached context."""

from __future__ import annotations

import re
import runpy
import sys

from tests.oracle import write_plan


def test_prefill_steps_lists_each_steps_chunks(tmp_path, tiny_models, monkeypatch, capsys):
    plan = write_plan(tmp_path, tiny_models("llama"), {"scheduler.max_num_batched_tokens": 48})
    argv = ["prefill_steps.py", str(plan), "--prompts", "3", "--prompt-len", "40", "--max-tokens", "2", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path("benchmarks/prefill_steps.py", run_name="__main__")
    out = capsys.readouterr().out
    assert re.search(r"^round 0: [\d.]+ s, \d+ steps$", out, re.M)
    steps = re.findall(r"^ +[\d.]+ ms  prefill \[(.*)\]  decodes (\d+)$", out, re.M)
    chunks = [[int(n) for n in chunk.split("+")] for prefill, _ in steps for chunk in prefill.split()]
    assert sum(new for new, _ in chunks) == 3 * 40  # every prompt token prefilled once
    assert any(context for _, context in chunks)  # a 48-token budget splits the 40-token prompts
    for prefill, decodes in steps:
        assert sum(int(c.split("+")[0]) for c in prefill.split()) + int(decodes) <= 48
