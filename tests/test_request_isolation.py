"""A request whose sampling, detokenization or stop handling fails is finished alone (finish_reason "error" with the
reason, blocks freed); the batch and the server go on, and the other requests' tokens do not change.

Faults are injected into the real engine: a NaN temperature set after validation (what issue 16's request reached
before the API rejected it: the sampler's "probability tensor contains either inf, nan" case), a generator torch
refuses, a detokenizer that raises. Multi-rank: rank 0 samples, and the followers keep in step."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.core.engine import LLMEngine
from tests.oracle import write_plan
from tests.test_server import MODEL, _dcpctl_run, _stop_and_check_tree, _wait_for_banner, serve, sse_events

POISON_ID = 423  # a stop token id only the poisoned request names: marks it for the hook that poisons its temperature
PROMPTS = ["the quick brown fox", "hello world, this is", "a b c d", "once upon a time"]
POISON_HOOK = f"""
import dataclasses, math, os
if os.environ.get("RANK", "0") == "0":
    from engine.core.engine import LLMEngine
    _add = LLMEngine.add_request
    def add_request(self, prompt, params, request_id=None, **options):
        seq = _add(self, prompt, params, request_id, **options)
        if {POISON_ID} in params.stop_token_ids:  # past validation: the sampler meets it
            seq.params = dataclasses.replace(params, temperature=math.nan)
        return seq
    LLMEngine.add_request = add_request
"""


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, tiny_models):
    with LLM(write_plan(tmp_path_factory.mktemp("isolation"), tiny_models("llama"))) as llm:
        yield llm


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_a_failed_sampling_finishes_only_its_request(llm):
    engine = llm.engine
    expected = [o.text for o in llm.generate(PROMPTS, greedy(12))]
    seqs = [engine.add_request(p, greedy(12)) for p in PROMPTS]
    seqs[1].params.temperature = math.nan
    run_to_end(engine)
    assert seqs[1].finish_reason == "error"
    assert seqs[1].error == "sampling failed: the next-token distribution has NaN or infinite values"
    assert [s.output_text for i, s in enumerate(seqs) if i != 1] == [t for i, t in enumerate(expected) if i != 1]
    assert all(s.finish_reason == "length" for i, s in enumerate(seqs) if i != 1)
    assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.running


def test_a_sampler_exception_is_isolated_by_sampling_rows_one_by_one(llm):
    engine = llm.engine
    expected = [o.text for o in llm.generate(PROMPTS, greedy(8))]
    seqs = [engine.add_request(p, greedy(8)) for p in PROMPTS]
    bad = engine.add_request("x y z", SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    engine.generators[bad.seq_id] = "not a generator"  # torch.multinomial raises TypeError on the batch
    run_to_end(engine)
    assert bad.finish_reason == "error" and bad.error.startswith("sampling failed: TypeError: ")
    assert [s.output_text for s in seqs] == expected
    assert engine.blocks.num_used_blocks == 0


def test_a_detokenizer_failure_finishes_only_its_request(llm, monkeypatch):
    engine = llm.engine
    expected = llm.generate(PROMPTS, greedy(10))
    seqs = [engine.add_request(p, greedy(10)) for p in PROMPTS]
    step = engine.detokenizer.step

    def failing_step(seq, final=False):
        if seq is seqs[2] and seq.num_output_tokens == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return step(seq, final)

    monkeypatch.setattr(engine.detokenizer, "step", failing_step)
    run_to_end(engine)
    assert seqs[2].finish_reason == "error" and "detokenizing or checking stops failed: UnicodeDecodeError" in (
        seqs[2].error
    )
    assert seqs[2].output_token_ids == expected[2].token_ids[:4]  # what it had when it failed
    assert [s.output_text for i, s in enumerate(seqs) if i != 2] == [o.text for i, o in enumerate(expected) if i != 2]
    assert engine.blocks.num_used_blocks == 0
    # the offline API reports it as an output with finish_reason "error" and the reason
    monkeypatch.setattr(engine.detokenizer, "step", lambda seq, final=False: 1 / 0)
    (out,) = llm.generate(["boom"], greedy(3))
    assert out.finish_reason == "error" and "ZeroDivisionError" in out.error


async def _concurrent(base_url: str, bodies: list[dict]) -> list[tuple[int, list]]:
    """Each body streamed (or not) at the same time: (status, SSE events or [JSON body])."""

    async def one(client: httpx.AsyncClient, body: dict) -> tuple[int, list]:
        if not body.get("stream"):
            resp = await client.post("/v1/completions", json=body)
            return resp.status_code, [resp.json()]
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            return resp.status_code, sse_events([line async for line in resp.aiter_lines()])

    async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=120) as client:
        return await asyncio.gather(*(one(client, b) for b in bodies))


def _check_poisoned_batch(base_url: str, expected: list[str]) -> None:
    """Normal streams next to a poisoned stream and a poisoned plain request: only the poisoned fail."""
    normal = [{"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True} for p in PROMPTS]
    poison = {"prompt": "poison", "max_tokens": 16, "temperature": 0.5, "stop_token_ids": [POISON_ID]}
    results = asyncio.run(_concurrent(base_url, [*normal, {**poison, "stream": True}, poison]))
    for (status, events), want in zip(results[: len(PROMPTS)], expected, strict=True):
        assert status == 200 and events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want
    status, events = results[-2]
    assert status == 200 and events[-1] == "[DONE]"
    message = events[-2]["error"]["message"]
    assert "the request failed: sampling failed: the next-token distribution has NaN" in message, events
    status, (body,) = results[-1]
    assert status == 500 and "sampling failed" in body["error"]["message"], body
    assert body["error"]["type"] == "server_error"
    with httpx.Client(base_url=base_url, trust_env=False, timeout=60) as http:
        assert http.get("/health").status_code == 200
        again = http.post("/v1/completions", json={**normal[0], "stream": False}).json()
        assert again["choices"][0]["text"] == expected[0]
        stats = http.get("/v1/engine/stats").json()
    assert stats["used_blocks"] == 0 and stats["requests_in_flight"] == 0


def test_a_poisoned_request_among_concurrent_streams(tmp_path, llm, monkeypatch):
    """The in-process server: its engine gets the poison hook's behaviour by wrapping its add_request."""
    expected = [o.text for o in llm.generate(PROMPTS, greedy(16))]
    served = serve(write_plan(tmp_path, Path(llm.engine.config.model_path)))
    add = served.engine.add_request

    def add_request(prompt, params, request_id=None, **options):
        seq = add(prompt, params, request_id, **options)
        if POISON_ID in params.stop_token_ids:
            seq.params.temperature = math.nan
        return seq

    monkeypatch.setattr(served.engine, "add_request", add_request)
    try:
        _check_poisoned_batch(served.base_url, expected)
    finally:
        served.handle.stop()


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_poisoned_request_on_a_dcp2_server_leaves_the_ranks_in_step(tmp_path, llm):
    """tp1/dcp2 under `dcpctl run`: rank 0 fails the poisoned request alone; both ranks go on in step (the next
    requests give the one-rank tokens) and the run stops cleanly."""
    from engine.runtime.launcher import free_port

    expected = [o.text for o in llm.generate(PROMPTS, greedy(16))]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(POISON_HOOK)
    plan = write_plan(tmp_path, Path(llm.engine.config.model_path))
    port = free_port()
    log = tmp_path / "run.log"
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    proc = _dcpctl_run(plan, ["parallel.dcp=2", f"serve.port={port}", f"serve.model_name={MODEL}"], log, env)
    try:
        _wait_for_banner(proc, log, timeout=240)
        _check_poisoned_batch(f"http://127.0.0.1:{port}", expected)
    finally:
        took = _stop_and_check_tree(proc, within=15)
    assert took < 15, log.read_text()[-2000:]


@pytest.mark.slow
def test_dcpctl_run_offline_reports_a_failed_prompt(tmp_path, llm):
    """`dcpctl run --prompt` (one rank): the poisoned prompt's record has finish_reason "error"; the others run."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        POISON_HOOK.replace(f"{POISON_ID} in params.stop_token_ids", "'#' in str(prompt)")
    )
    out = tmp_path / "out.jsonl"
    plan = write_plan(tmp_path, Path(llm.engine.config.model_path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), "--prompt", "fine", "--prompt", "#bad"]
    cmd += ["--max-tokens", "4", "--output", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in records] == ["length", "error"]
    assert "sampling failed" in records[1]["error"]
