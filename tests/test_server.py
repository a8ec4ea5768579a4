"""The OpenAI-compatible server: real uvicorn on 127.0.0.1, the real `openai` client and httpx, our engine on tiny
checkpoints; outputs checked against offline generation and HF transformers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.core.engine import LLMEngine
from engine.core.startup import start_rank
from engine.plan.checks import resolve_plan
from engine.serving.engine_loop import EngineLoop, EngineRequest, Sink, Update
from engine.serving.hosting import ServerHandle, start_server
from engine.serving.responses import CompletionLogprobs, stop_holdback
from tests.oracle import hf_greedy, hf_prompt_logprobs, prompt_ids, write_plan

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
PROMPTS = ["the quick brown fox", "hello world, this is a test of", "a"]
LOGPROB_TOL = 1e-4


@dataclass
class Served:
    plan: Path
    engine: LLMEngine
    handle: ServerHandle

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.handle.port}"

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, trust_env=False)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, http_client=httpx.Client(trust_env=False)
        )

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/v1/engine/stats", trust_env=False).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Stats once no request is in flight (or the last stats after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["requests_in_flight"] == 0 and stats["running"] == 0 and stats["waiting"] == 0:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def serve(plan: Path, model_name: str = MODEL) -> Served:
    config, par, runner = start_rank(resolve_plan(plan))
    engine = LLMEngine(config, par, runner)
    return Served(plan, engine, start_server(engine, model_name))


@pytest.fixture(scope="module")
def llama(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def server(tmp_path_factory, llama):
    served = serve(write_plan(tmp_path_factory.mktemp("server"), llama))
    yield served
    served.handle.stop()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, llama):
    """A server whose context is 64 tokens."""
    served = serve(write_plan(tmp_path_factory.mktemp("small"), llama, {"model.max_model_len": 64}))
    yield served
    served.handle.stop()


@pytest.fixture(scope="module")
def offline(server):
    with LLM(server.plan) as llm:
        yield llm


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream, with '[DONE]' as a string; asserts the framing."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def token_boundary_stop(text: str, token_texts: list[str]) -> tuple[str, str]:
    """A 4-character ASCII stop string that straddles two tokens and first occurs there; returns (stop, expected)."""
    offset = 0
    for piece in token_texts[:-1]:
        offset += len(piece)
        stop = text[offset - 2 : offset + 2]
        if offset >= 4 and len(stop) == 4 and stop.isascii() and stop.isprintable() and text.find(stop) == offset - 2:
            return stop, text[: offset - 2]
    raise AssertionError(f"no usable stop string in {text!r}")


# ---- basics ----


def test_health_models_and_stats(server):
    with server.http() as http:
        health = http.get("/health").json()
        assert health["status"] == "ok" and len(health["instance_id"]) == 32  # a router tells restarts by it
        assert http.get("/health").json() == health
        models = http.get("/v1/models").json()
        stats = http.get("/v1/engine/stats").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert stats["num_blocks"] == server.engine.blocks.num_blocks > 0
    assert stats["used_blocks"] + stats["free_blocks"] == stats["num_blocks"]


def test_greedy_completion_equals_offline(server, offline):
    expected = offline.generate(PROMPTS, greedy(24))
    client = server.client()
    for prompt, out in zip(PROMPTS, expected, strict=True):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0)
        (choice,) = resp.choices
        assert choice.text == out.text
        assert choice.finish_reason == out.finish_reason
        assert resp.usage.completion_tokens == len(out.token_ids)
        assert resp.usage.prompt_tokens == len(out.prompt_token_ids)
        # token for token: the logprobs tokens are the decoded generated ids
        assert choice.logprobs.tokens == [offline.tokenizer.decode([t]) for t in out.token_ids]
    # a batch of prompts: one choice per prompt, in order; token-id prompts work the same
    ids = [offline.engine.tokenize(p) for p in PROMPTS]
    for prompt in (PROMPTS, ids):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert [c.text for c in resp.choices] == [o.text for o in expected]
        assert resp.usage.prompt_tokens == sum(len(i) for i in ids)


def test_completion_defaults_to_16_tokens_and_honours_n_and_seed(server):
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt="hello", extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"
    kw = dict(model=MODEL, prompt="hello", max_tokens=12, temperature=1.0, seed=3, n=3, extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # ...but the n samples differ from each other


def test_chat_completion_uses_the_chat_template(server, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
    text = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = offline.tokenizer(text, add_special_tokens=False).input_ids
    (expected,) = offline.generate([ids], greedy(20))
    resp = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    # content given as a list of text parts is the same message
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        messages[1],
    ]
    again = server.client().chat.completions.create(model=MODEL, messages=parts, max_tokens=20, temperature=0)
    assert again.choices[0].message.content == expected.text


def test_chat_default_max_tokens_runs_to_the_context_limit(small_server):
    resp = small_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.total_tokens == 64


# ---- streaming ----


def test_streaming_assembles_to_the_non_streaming_text(server):
    client = server.client()
    for prompt in PROMPTS:
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text_chunks = [c for c in chunks if c.choices]
        assert len(text_chunks) > 3  # really streamed, not one blob
        assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
        assert [c.choices[0].finish_reason for c in text_chunks][-1] == full.choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    messages = [{"role": "user", "content": "tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked


def test_a_whole_response_is_one_update_at_its_finish_a_streamed_one_an_update_per_token(tmp_path, llama):
    """The engine thread wakes a whole response's handler once, at the finish, with every token (a batch of them
    would otherwise wake the server's thread, and take its GIL and a core from the engine thread, at every step);
    a streamed response gets each step's token as it comes."""
    config, par, runner = start_rank(resolve_plan(write_plan(tmp_path, llama)))
    engine_loop = EngineLoop(LLMEngine(config, par, runner)).start()

    async def updates(stream: bool) -> list[Update]:
        sink = Sink()
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
        await engine_loop.add([EngineRequest(f"req-{stream}", 0, 0, [5, 6, 7, 8], params, stream=stream)], sink, False)
        seen = [await sink.queue.get()]
        while seen[-1].finish_reason is None and seen[-1].error is None:
            seen.append(await sink.queue.get())
        return seen

    try:
        whole, streamed = asyncio.run(updates(False)), asyncio.run(updates(True))
    finally:
        engine_loop.stop()
    assert [len(u.token_ids) for u in streamed] == [1] * 6
    assert len(whole) == 1 and whole[0].finish_reason == "length"
    assert whole[0].token_ids == [t for u in streamed for t in u.token_ids]
    assert whole[0].logprobs == [lp for u in streamed for lp in u.logprobs] and len(whole[0].logprobs) == 6
    assert whole[0].text == streamed[-1].text


def test_sse_framing_ends_with_done(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": 0, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events[:-1])


# ---- stop strings ----


def test_stop_holdback_is_the_longest_end_that_could_start_a_stop():
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 3))]
        ends = [k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])]
        assert stop_holdback(text, stops) == max(ends, default=0), (text, stops)


def test_stop_strings_cut_the_text_streaming_and_not(server):
    client = server.client()
    prompt = "the quick brown fox"
    free = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop, expected = token_boundary_stop(text, free.choices[0].logprobs.tokens)
    never = stop[:2] + "\x07"  # its start occurs in the text, the whole never does: held back, then released
    cases = [
        ([stop], expected, "stop"),
        (stop, expected, "stop"),
        ([never, stop], expected, "stop"),
        ([never], text, "length"),
    ]
    for stops, want, finish in cases:
        kw = dict(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=stops, extra_body={"ignore_eos": True})
        resp = client.completions.create(**kw)
        assert (resp.choices[0].text, resp.choices[0].finish_reason) == (want, finish), stops
        assert resp.choices[0].model_extra["stop_reason"] == (stop if finish == "stop" else None)
        streamed = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
        assert "".join(c.text for c in streamed) == want, stops
        assert streamed[-1].finish_reason == finish
        assert finish == "length" or not any(stop in c.text for c in streamed)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chat_text = chat.choices[0].message.content
    start = next(
        i
        for i in range(3, len(chat_text) - 3)
        if chat_text[i : i + 3].isascii()
        and chat_text[i : i + 3].isprintable()
        and chat_text.find(chat_text[i : i + 3]) == i
    )
    chat_stop = chat_text[start : start + 3]
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=32,
        temperature=0,
        stop=[chat_stop],
        extra_body={"ignore_eos": True},
    )
    assert client.chat.completions.create(**kw).choices[0].message.content == chat_text[:start]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    assert streamed == chat_text[:start]


def test_lm_eval_generate_until_request(server, offline):
    """What lm-eval's local-completions sends for gsm8k: the text comes back cut at the first stop string."""
    prompt = "Question: what is one plus one?\nAnswer:"
    (free,) = offline.generate([prompt], greedy(40, ignore_eos=True))
    stop = free.text[6:9]
    body = {
        "prompt": prompt,
        "model": MODEL,
        "max_tokens": 40,
        "temperature": 0.0,
        "stop": ["Question:", "</s>", "<|im_end|>", stop],
        "seed": 1234,
        "ignore_eos": True,
    }
    with server.http() as http:
        resp = http.post("/v1/completions", json=body).json()
    assert resp["choices"][0]["text"] == free.text[: free.text.index(stop)]
    assert resp["choices"][0]["finish_reason"] == "stop"


# ---- logprobs and echo ----


def test_echo_logprobs_match_hf(server, llama):
    ids = prompt_ids(1, [20], seed=11)[0]
    hf_prompt = hf_prompt_logprobs(llama, ids)
    (hf_next,), (hf_next_lp,) = hf_greedy(llama, ids, 1)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    with server.http() as http:
        first = http.post("/v1/completions", json=body).json()
        again = http.post("/v1/completions", json=body).json()  # the prompt is in the prefix cache now
        only_prompt = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()
        exact = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    for resp in (first, again):
        (choice,) = resp["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ours = lp["token_logprobs"][1 : len(ids)]
        assert max(abs(a - b) for a, b in zip(ours, hf_prompt, strict=True)) < LOGPROB_TOL
        assert abs(lp["token_logprobs"][-1] - hf_next_lp) < LOGPROB_TOL
        decoded = server.engine.tokenizer.decode
        assert lp["tokens"] == [decoded([t]) for t in [*ids, hf_next]]
        assert choice["text"] == decoded(ids) + decoded([hf_next])
        # text_offset: where each token starts in the returned text
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert top[token] >= value and len(top) <= 2  # the top-1 plus the actual token (ids may decode alike)
        # lm-eval's greedy check on the generated token: its logprob is the top one
        assert max(lp["top_logprobs"][-1].values()) == lp["token_logprobs"][-1]
        assert resp["usage"] == {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}
    # with token-id names the top dicts are exact: the chosen id with its own logprob, plus the top-1
    lp = exact["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in [*ids, hf_next]]
    assert lp["text_offset"] == first["choices"][0]["logprobs"]["text_offset"]
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[token] == value and 1 <= len(top) <= 2
    lp = only_prompt["choices"][0]["logprobs"]
    assert only_prompt["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"] == first["choices"][0]["logprobs"]["token_logprobs"][:-1]
    assert only_prompt["choices"][0]["text"] == server.engine.tokenizer.decode(ids)


def test_echo_streaming_and_chat_logprobs(server):
    client = server.client()
    kw = dict(model=MODEL, prompt="hello there", max_tokens=6, temperature=0, echo=True, logprobs=2)
    full = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    assert chunks[0].text == "hello there"
    assert "".join(c.text for c in chunks) == full.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == full.logprobs.token_logprobs
    offsets = [v for c in chunks if c.logprobs for v in c.logprobs.text_offset]
    assert offsets == full.logprobs.text_offset
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == item.logprob  # greedy: the chosen token is the top one
        assert bytes(item.bytes).decode() == item.token


# ---- errors ----


def test_user_errors_are_openai_4xx_and_the_server_keeps_serving(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=list(range(3, 603)), max_tokens=4)
    message = err.value.body["message"]
    assert "600" in message and "512" in message, message
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert err.value.body["param"] == "temperature" and "temperature=-1" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi")
    assert "gpt-4" in err.value.body["message"] and MODEL in err.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=0, stream=True)

    bad_bodies = {
        "{not json": "not valid JSON",
        "[1, 2]": "JSON object",
        json.dumps({"model": MODEL}): "prompt",
        json.dumps({"prompt": "x", "max_tokens": "many"}): "max_tokens",
        json.dumps({"prompt": [1, "a"]}): "prompt",
        json.dumps({"prompt": ""}): "empty",
        json.dumps({"prompt": []}): "empty",
        json.dumps({"prompt": [[1, 2], []]}): "prompt 1 is an empty token list",
        json.dumps({"prompt": [5, 99999]}): "token ids must be in 0..",
        json.dumps({"prompt": [[5, 6], list(range(3, 603))]}): "prompt 1: the prompt has 600 tokens",
        json.dumps({"prompt": ["ok", [5, 6]]}): "prompt must be a string, a list of strings",
        json.dumps({"prompt": "x", "n": 0}): "n=0",
        json.dumps({"prompt": "x", "seed": 2**70}): "seed=",
        json.dumps({"prompt": "x", "logprobs": 50}): "logprobs=50",
        json.dumps({"prompt": "x", "stop": [""]}): "stop",
        json.dumps({"prompt": "x", "presence_penalty": 0.5}): "presence_penalty",
        json.dumps({"prompt": "x", "stream": True, "max_tokens": -1}): "max_tokens=-1",
    }
    with server.http() as http:
        for body, needle in bad_bodies.items():
            resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, (body, resp.text)
            error = resp.json()["error"]
            assert needle in error["message"], (body, error)
            assert set(error) == {"message", "type", "param", "code"}
        chat_bad = [
            {"messages": []},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        ]
        for body in chat_bad:
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["error"]["message"]
        resp = http.get("/v1/nothing")
        assert resp.status_code == 404 and "error" in resp.json()
        assert http.get("/health").status_code == 200
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    assert server.wait_idle()["used_blocks"] == 0


# ---- aborts, failures, load ----


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = server.wait_idle()["generated_tokens"]
    limit = 480  # far more than the few tokens it produces before the client goes away
    body = {
        "model": MODEL,
        "prompt": "tell me everything",
        "max_tokens": limit,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.stats()["used_blocks"] > 0
    stats = server.wait_idle()
    assert stats["used_blocks"] == 0 and stats["requests_in_flight"] == 0
    assert stats["generated_tokens"] - before < limit
    # a non-streaming request whose client gives up is aborted too
    body["stream"] = False
    before = stats["generated_tokens"]
    with server.http(timeout=0.1) as http, pytest.raises(httpx.ReadTimeout):  # 480 tokens take longer
        http.post("/v1/completions", json=body)
    stats = server.wait_idle()
    assert stats["used_blocks"] == 0 and stats["generated_tokens"] - before < limit


def test_a_stream_that_fails_unexpectedly_ends_with_an_error_event_and_is_logged(server, monkeypatch, caplog):
    """A bug while building a stream (fault injected into the logprobs of its chunks) is no cut connection: the
    client reads an error event and [DONE], the log has the traceback, and the server goes on holding nothing."""

    def broken(*_):
        raise RuntimeError("injected stream fault")

    monkeypatch.setattr(CompletionLogprobs, "block", broken)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "logprobs": 1, "stream": True, "ignore_eos": True}
    with (
        caplog.at_level(logging.ERROR, logger="dcpctl.server"),
        server.http() as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "internal error: RuntimeError: injected stream fault", events[-2]
    (record,) = [r for r in caplog.records if "a stream failed unexpectedly" in r.getMessage()]
    assert "injected stream fault" in str(record.exc_info[1])
    monkeypatch.undo()
    stats = server.wait_idle()
    assert stats["used_blocks"] == 0 and stats["requests_in_flight"] == 0
    with server.http() as http:
        assert http.post("/v1/completions", json={**body, "stream": False}).status_code == 200


def test_engine_failure_is_a_500_and_health_turns_unhealthy(tmp_path, llama):
    served = serve(write_plan(tmp_path, llama))
    runner = served.engine.runner
    execute, calls = runner.execute, []

    def failing_execute(plan):  # fault injection: the 6th step of the real runner raises
        calls.append(plan)
        if len(calls) >= 6:
            raise RuntimeError("injected fault")
        return execute(plan)

    runner.execute = failing_execute
    try:
        with served.http() as http:
            body = {
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 50,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            with http.stream("POST", "/v1/completions", json=body) as resp:
                events = sse_events(resp.iter_lines())
            assert "injected fault" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
            resp = http.post("/v1/completions", json={**body, "stream": False})
            assert resp.status_code >= 500 and "injected fault" in resp.json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503 and "injected fault" in health.json()["error"]
    finally:
        served.handle.stop()


def test_64_concurrent_streams_are_batched_and_all_complete(server, offline):
    prompts = [f"request number {i}: " + "abc " * (i % 7) for i in range(64)]
    new_tokens = 24
    expected = offline.generate(prompts, greedy(new_tokens, ignore_eos=True))
    before = server.wait_idle()

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=new_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, used = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, finish, used

    async def main():
        http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=100), timeout=120)
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, http_client=http)
        async with http:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 64
    assert [r[0] for r in results] == [o.text for o in expected]
    assert all(finish == "length" and used == new_tokens for _, finish, used in results)
    after = server.wait_idle()
    assert after["used_blocks"] == 0 and after["requests_in_flight"] == 0
    steps = after["steps"] - before["steps"]
    tokens = after["generated_tokens"] - before["generated_tokens"]
    assert tokens == 64 * new_tokens
    assert steps < tokens / 4, (steps, tokens)  # batched: many sequences per step, not one at a time
    assert after["peak_running"] > 8


# ---- the command line ----


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _wait_for_banner(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("serving "):
                return line
        if proc.poll() is not None:
            raise AssertionError(f"dcpctl run exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no 'serving' line within {timeout} s: {log.read_text()[-2000:]}")


def _stop_and_check_tree(proc: subprocess.Popen, within: float) -> float:
    """SIGINT `proc`; every process of its tree must be gone within `within` seconds; returns the time taken."""
    import psutil

    tree = [psutil.Process(proc.pid), *_descendants(proc.pid)]
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=within)
        _, alive = psutil.wait_procs(tree, timeout=max(0.1, within - (time.monotonic() - start)))
    finally:
        for p in tree:
            if p.is_running():
                p.kill()
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    return time.monotonic() - start


def _dcpctl_run(plan: Path, overrides: list[str], log: Path, extra_env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_dcpctl_run_serves_on_port_0_and_stops_on_sigint(tmp_path, llama, server):
    log = tmp_path / "run.log"
    proc = _dcpctl_run(write_plan(tmp_path, llama), ["serve.port=0", f"serve.model_name={MODEL}"], log)
    try:
        banner = _wait_for_banner(proc, log, timeout=120)
        url = banner.split(" on ")[1].split()[0]
        assert banner.startswith(f"serving {MODEL} on http://127.0.0.1:")
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
        theirs = httpx.post(f"{url}/v1/completions", json=body, trust_env=False, timeout=60).json()
        ours = httpx.post(f"{server.base_url}/v1/completions", json=body, trust_env=False, timeout=60).json()
        assert theirs["choices"][0]["text"] == ours["choices"][0]["text"]
    finally:
        took = _stop_and_check_tree(proc, within=15)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert took < 15


@pytest.mark.slow
@pytest.mark.multiproc
def test_dcpctl_run_tp2_dcp2_serves_like_one_rank(tmp_path, tiny_models):
    from engine.runtime.launcher import free_port

    folder = tiny_models("deepseek_v2")
    plan = write_plan(tmp_path, folder, {"cache.memory": "8MiB"})
    single = serve(plan, model_name="ds")
    port = free_port()
    log = tmp_path / "run.log"
    proc = _dcpctl_run(plan, ["parallel.tp=2", "parallel.dcp=2", f"serve.port={port}", "serve.model_name=ds"], log)
    try:
        banner = _wait_for_banner(proc, log, timeout=240)
        assert banner.startswith(f"serving ds on http://127.0.0.1:{port}")
        assert len(_descendants(proc.pid)) >= 3  # torchrun and its two ranks
        body = {"model": "ds", "prompt": PROMPTS, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        with httpx.Client(timeout=120, trust_env=False) as http:
            theirs = http.post(f"http://127.0.0.1:{port}/v1/completions", json=body).json()
            ours = http.post(f"{single.base_url}/v1/completions", json=body).json()
            chat = {
                "model": "ds",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
            }
            with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=chat) as resp:
                streamed = sse_events(resp.iter_lines())
            ours_chat = http.post(f"{single.base_url}/v1/chat/completions", json={**chat, "stream": False}).json()
        assert [c["text"] for c in theirs["choices"]] == [c["text"] for c in ours["choices"]]
        tokens = [[c["logprobs"]["tokens"] for c in resp["choices"]] for resp in (theirs, ours)]
        assert tokens[0] == tokens[1]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[:-1] if e["choices"])
        assert text == ours_chat["choices"][0]["message"]["content"]
    finally:
        single.handle.stop()
        took = _stop_and_check_tree(proc, within=15)
    assert took < 15, log.read_text()[-2000:]
