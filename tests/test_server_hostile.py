"""No request can take the server down: hand-written hostile requests (regressions) and schemathesis fuzzing from
the server's own OpenAPI document, against a real server on a tiny checkpoint, and against the router of a P/D
deployment of the same checkpoint (`python -m engine.serve_entry PD_PLAN`, as `dcpctl run` serves it), which faces
the same clients. Every bad request is an OpenAI-style 4xx naming the problem; afterwards the server is healthy and
holds no KV blocks (the P/D deployment: neither instance holds a block or an export)."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from engine.serving.plan_server import PlanServer
from engine.serving.protocol import MAX_BODY_BYTES
from tests.oracle import write_plan
from tests.test_pd import pd_plan
from tests.test_server import serve

CONTEXT = 48  # the server's max_model_len: generation stays short whatever a request asks for
JSON = {"content-type": "application/json"}
NON_FINITE = ("NaN", "Infinity", "-Infinity")
NUMERIC_FIELDS = {  # every numeric request field, completions and chat
    "/v1/completions": [
        "temperature",
        "top_p",
        "top_k",
        "n",
        "seed",
        "max_tokens",
        "logprobs",
        "best_of",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
    ],
    "/v1/chat/completions": ["temperature", "top_p", "top_k", "n", "seed", "max_tokens", "max_completion_tokens"],
}
BASE = {
    "/v1/completions": {"prompt": "hello"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
}


@dataclass
class Target:
    """What the tests send requests to (a server, or a P/D deployment's router) and what they know of its model."""

    base_url: str
    folder: Path
    routed: bool  # the router of a P/D deployment

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, trust_env=False)

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)

    @property
    def vocab_size(self) -> int:
        return json.loads((self.folder / "config.json").read_text())["vocab_size"]

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Stats once no request is in flight (and, behind a router, no block or export is held on either side;
        releases run in the background), or the last stats after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            stats = httpx.get(f"{self.base_url}/v1/engine/stats", trust_env=False, timeout=30).json()
            idle = stats["requests_in_flight"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
            if self.routed:
                prefill = stats["prefill"]
                idle = idle and stats["used_blocks"] == 0 and prefill["used_blocks"] == 0
                idle = idle and prefill["exports_live"] == 0 and prefill["requests_in_flight"] == 0
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


@pytest.fixture(scope="module", params=["server", pytest.param("router", marks=pytest.mark.multiproc)])
def server(request, tmp_path_factory, tiny_models) -> Iterator[Target]:
    folder = tiny_models("llama")
    tmp = tmp_path_factory.mktemp(f"hostile-{request.param}")
    if request.param == "server":
        served = serve(write_plan(tmp, folder, {"model.max_model_len": CONTEXT}))
        yield Target(served.base_url, folder, routed=False)
        served.handle.stop()
        return
    context = {"model.max_model_len": CONTEXT}
    plan = pd_plan(tmp, folder, context, context)
    with PlanServer(plan, log_path=tmp / "pd.log", health_timeout_s=300) as deployment:
        yield Target(deployment.base_url, folder, routed=True)


@pytest.fixture
def http(server):
    with server.http() as client:
        yield client
    # whatever the test sent, the server still serves and holds no blocks
    assert server.wait_idle()["used_blocks"] == 0
    with server.http() as client:
        assert client.get("/health").status_code == 200


def post_raw(http: httpx.Client, path: str, body: str | bytes) -> httpx.Response:
    return http.post(path, content=body, headers=JSON)


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return error


def with_field(path: str, name: str, literal: str) -> str:
    """The base body of `path` with `"name": literal` spliced in as raw JSON text (NaN is not valid JSON)."""
    return json.dumps(BASE[path])[:-1] + f', "{name}": {literal}}}'


def test_non_finite_numbers_in_every_field_are_400_naming_the_field(http):
    for path, names in NUMERIC_FIELDS.items():
        for name in names:
            for literal in NON_FINITE:
                error = error_of(post_raw(http, path, with_field(path, name, literal)))
                assert error["param"] == name, (path, name, literal, error)
                # an integer field says it wants an integer (a non-finite number is a float)
                assert f"{name}=" in error["message"], error
                assert "finite" in error["message"] or "valid integer" in error["message"], error
    body = with_field("/v1/completions", "logit_bias", '{"5": NaN}')
    assert error_of(post_raw(http, "/v1/completions", body))["param"] == "logit_bias"
    body = with_field("/v1/chat/completions", "top_logprobs", "Infinity")
    assert error_of(post_raw(http, "/v1/chat/completions", body))["param"] == "top_logprobs"


def test_huge_numbers_are_400_or_harmless(http):
    huge = str(10**30)
    for name in ("n", "seed", "logprobs", "max_tokens"):
        error = error_of(post_raw(http, "/v1/completions", with_field("/v1/completions", name, huge)))
        assert error["param"] == name
    # a top_k beyond the vocabulary is no top-k, a huge temperature is near-uniform, a tiny one near-greedy
    for name, literal in (("top_k", huge), ("temperature", "1e308"), ("temperature", "1e-320")):
        resp = post_raw(
            http, "/v1/completions", with_field("/v1/completions", name, literal)[:-1] + ', "max_tokens": 4}'
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1, (name, resp.text)


def test_stops_beyond_the_limits_are_400_and_stop_token_ids_must_be_in_the_vocabulary(server, http):
    vocab = server.vocab_size
    cases = {
        "stop has 65 strings; this server takes at most 64": {"stop": ["x"] * 65},
        "stop has 500000 strings": {"stop": ["ab"] * 500_000},
        "stop.1 has 257 characters; this server takes stop strings of at most 256": {"stop": ["a", "b" * 257]},
        "stop has 5000 characters": {"stop": "b" * 5000},
        f"stop_token_ids must be in 0..{vocab - 1} (got -5)": {"stop_token_ids": [5, 10**30, -5]},
        f"(got {10**30})": {"stop_token_ids": [10**30]},
        "stop_token_ids must be in": {"stop_token_ids": [vocab]},
    }
    for needle, extra in cases.items():
        for path, base in BASE.items():
            error = error_of(http.post(path, json={**base, **extra}))
            assert needle in error["message"] and error["param"] == next(iter(extra)), (path, needle, error)
    # at the limits, and a long list of ids in the vocabulary (held as a set), are fine
    body = {"prompt": "x", "max_tokens": 3, "stop": ["q" * 256] * 64, "stop_token_ids": list(range(vocab)) * 100}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_max_tokens_beyond_the_context_is_400_naming_both_lengths(http):
    ids = [5, 6, 7, 8, 9]
    error = error_of(http.post("/v1/completions", json={"prompt": ids, "max_tokens": 10**9}))
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    message = error["message"]
    assert "max_tokens=1000000000" in message and "5 tokens" in message and f"is {CONTEXT}" in message, message
    assert f"at most {CONTEXT - 5}" in message
    # exactly filling the context is fine
    ok = http.post("/v1/completions", json={"prompt": ids, "max_tokens": CONTEXT - 5, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == CONTEXT
    error = error_of(http.post("/v1/completions", json={"prompt": [[5], ids], "max_tokens": CONTEXT - 3}))
    assert error["message"].startswith("prompt 1: max_tokens=")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for name in ("max_tokens", "max_completion_tokens"):
        error = error_of(http.post("/v1/chat/completions", json={**chat, name: 10**6}))
        assert error["param"] == name and error["code"] == "context_length_exceeded"


def test_wrong_types_are_400(http):
    bodies = {
        '{"prompt": {"a": 1}}': "prompt must be a string",
        '{"prompt": "x", "stop": [1, 2]}': "stop must be a non-empty string or a list of non-empty strings",
        '{"prompt": "x", "n": "three"}': "n='three'",
        '{"prompt": "x", "stream": {"yes": true}}': "stream",
        '{"prompt": "x", "stream_options": [1]}': "stream_options",
        '{"prompt": "x", "temperature": [0.5]}': "temperature",
        '{"prompt": "x", "logit_bias": "none"}': "logit_bias",
        '{"prompt": null}': "prompt",
        "[]": "must be a JSON object",
        '"just a string"': "must be a JSON object",
        "": "empty",
    }
    for body, needle in bodies.items():
        assert needle in error_of(post_raw(http, "/v1/completions", body))["message"], body
    chat_bodies = [
        {"messages": "hello"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"messages": [{"role": "user", "content": "x"}], "logprobs": "maybe"},
    ]
    for body in chat_bodies:
        error_of(http.post("/v1/chat/completions", json=body))
    assert "tokens" in error_of(http.post("/detokenize", json={"tokens": "abc"}))["message"]
    assert "prompt" in error_of(http.post("/tokenize", json={"prompt": ["a"]}))["message"]


def test_text_that_is_not_valid_unicode_is_400_naming_the_field(http):
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"); no tokenizer (or UTF-8 encoder) can take it."""
    lone = "ab\ud800"
    cases = [
        ("/v1/completions", {"prompt": lone}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": ["fine", lone]}, "prompt", "prompt.1"),
        ("/v1/completions", {"prompt": "x", "stop": lone}, "stop", "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", "\udfff"]}, "stop", "stop.1"),
        ("/tokenize", {"prompt": lone}, "prompt", "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": lone}]}, "messages", "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": lone}]}]},
            "messages",
            "messages.0.content.0.text",
        ),
    ]
    for path, body, param, where in cases:
        error = error_of(post_raw(http, path, json.dumps(body)))
        assert error["param"] == param, (body, error)
        message = error["message"]
        assert message.startswith(f"{where} is not valid Unicode") and "UTF-8" in message, (body, message)
    # a valid pair of surrogates is one character, and a backslash before "u" is no escape
    for prompt in ("\U0001f600", "\\ud800"):
        assert post_raw(http, "/tokenize", json.dumps({"prompt": prompt})).status_code == 200


def test_json_types_are_not_coerced(http):
    for name, value in (("max_tokens", "3"), ("max_tokens", True), ("max_tokens", 3.5), ("stream", "yes")):
        error = error_of(http.post("/v1/completions", json={"prompt": "x", name: value}))
        assert error["param"] == name and f"{name}={value!r}" in error["message"], error
    for name, value in (("temperature", "0.5"), ("logprobs", False), ("n", 1.0), ("echo", 1)):
        assert error_of(http.post("/v1/completions", json={"prompt": "x", name: value}))["param"] == name
    chat = BASE["/v1/chat/completions"]
    assert error_of(http.post("/v1/chat/completions", json={**chat, "logprobs": "true"}))["param"] == "logprobs"
    # a JSON integer is a number
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0, "top_p": 1}).is_success


def test_head_probes_and_the_allow_header_of_a_405(http):
    for path in ("/health", "/v1/models"):
        resp = http.head(path)
        assert resp.status_code == 200 and resp.content == b"", path
    resp = http.post("/health")
    assert error_of(resp, status=405) and "GET" in resp.headers["allow"]
    resp = http.get("/v1/completions")
    assert error_of(resp, status=405) and resp.headers["allow"] == "POST"


def test_unknown_chat_role_is_400(http):
    error = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}))
    assert error["param"] == "messages" and "messages.0.role='wizard'" in error["message"]
    assert "'user'" in error["message"]


def test_unparsable_bodies_are_400(http):
    deep = "[" * 50_000 + "]" * 50_000
    assert "nests JSON too deeply" in error_of(post_raw(http, "/v1/completions", deep))["message"]
    deep_object = '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}"
    assert "too deeply" in error_of(post_raw(http, "/v1/chat/completions", deep_object))["message"]
    bad_utf8 = b'{"prompt": "\xff\xfe caf\xe9"}'
    assert "not UTF-8 (byte 0xff at offset 12)" in error_of(post_raw(http, "/v1/completions", bad_utf8))["message"]
    for body in ("{not json", '{"prompt": "x",}', '{"prompt": "x"} trailing'):
        assert "not valid JSON" in error_of(post_raw(http, "/v1/completions", body))["message"], body
    # no content type: the body cannot be read as JSON, and the message says what to send
    resp = http.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in error_of(resp)["message"]


def test_oversized_bodies_are_413_before_they_are_read(http):
    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    error = error_of(post_raw(http, "/v1/completions", big), status=413)
    assert str(MAX_BODY_BYTES) in error["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            yield b"a" * 2**20
        yield b'"}'

    error_of(http.post("/v1/completions", content=chunks(), headers=JSON), status=413)


def test_token_ids_out_of_the_vocabulary_are_400(server, http):
    vocab = server.vocab_size
    for prompt in ([vocab], [-1], [5, 10**30], [[5], [vocab + 7]]):
        error = error_of(http.post("/v1/completions", json={"prompt": prompt}))
        assert f"0..{vocab - 1}" in error["message"] and error["param"] == "prompt", (prompt, error)
    for tokens in ([len(server.tokenizer)], [-3], [10**30]):
        assert "tokens must be in" in error_of(http.post("/detokenize", json={"tokens": tokens}))["message"]


def test_errors_about_a_field_name_it_as_param(http):
    chat = BASE["/v1/chat/completions"]
    cases = [
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[5], []]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "suffix": "tail"}, "suffix"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
    ]
    for path, body, param in cases:
        assert error_of(http.post(path, json=body))["param"] == param, body


def test_a_response_of_too_many_logprobs_is_400(http):
    ids = list(range(3, 3 + CONTEXT - 8))
    body = {"prompt": [ids] * 32, "max_tokens": 1, "n": 128, "echo": True, "logprobs": 20}
    error = error_of(http.post("/v1/completions", json=body))
    assert error["param"] == "logprobs"
    assert error["message"].startswith("logprobs=20 for 4096 choices of up to 41 tokens")
    assert "lower logprobs, n or max_tokens" in error["message"]
    resp = http.post("/v1/completions", json={**body, "prompt": ids, "n": 16})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 16


def test_too_many_choices_is_400(http):
    error = error_of(http.post("/v1/completions", json={"prompt": ["a"] * 40, "n": 128}))
    assert "n=128" in error["message"] and "40 prompts" in error["message"]


def slowest_health_while(server, send: Callable[[httpx.Client], httpx.Response]) -> tuple[httpx.Response, float]:
    """`send`'s response and the slowest /health answer (seconds) seen while it was in flight."""
    result: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: result.append(send(server.http(timeout=300))))
    worker.start()
    slowest = 0.0
    with server.http(timeout=300) as health:
        while worker.is_alive():
            start = time.monotonic()
            assert health.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.05)
    worker.join()
    return result[0], slowest


def test_a_text_too_long_to_fit_is_refused_before_it_is_tokenized(server, http):
    huge = "hello world " * 2_500_000  # 30 MB: tokenizing it takes tens of seconds here
    longest = max(map(len, server.tokenizer.get_vocab()))
    requests = {
        "/v1/completions": {"prompt": huge, "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": huge}], "max_tokens": 1},
    }
    for path, body in requests.items():
        resp, slowest = slowest_health_while(server, lambda client, p=path, b=body: client.post(p, json=b))
        error = error_of(resp)
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == ("prompt" if "prompt" in body else "messages")
        at_least = int(error["message"].removeprefix("the prompt has at least ").split()[0])
        assert at_least >= len(huge) / longest > CONTEXT
        assert f"max_model_len is {CONTEXT}; shorten the prompt" in error["message"]
        assert slowest < 10, (path, slowest)
    # many long prompts: the first that cannot fit fails the request at once
    started = time.monotonic()
    error = error_of(http.post("/v1/completions", json={"prompt": ["a b", "x" * 24_000, *["y" * 24_000] * 1300]}))
    assert error["message"].startswith("prompt 1: the prompt has at least") and time.monotonic() - started < 20
    # short enough in characters, too many tokens: the tokens are counted
    error = error_of(http.post("/v1/completions", json={"prompt": ["a b", "a " * CONTEXT, "y" * 24_000]}))
    assert error["message"].startswith("prompt 1: the prompt has ") and "at least" not in error["message"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_tokenizing_a_long_text_leaves_the_server_serving(server):
    text = "hello world " * 1_000_000  # /tokenize takes any length (lm-eval tokenizes whole documents)
    resp, slowest = slowest_health_while(server, lambda client: client.post("/tokenize", json={"prompt": text}))
    assert resp.status_code == 200 and resp.json()["count"] >= 2_000_000
    assert slowest < 5, slowest


def test_openapi_document_describes_the_request_bodies(server):
    with server.http() as http:
        doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["temperature"]["anyOf"][0]["minimum"] == 0
    assert completion["n"]["maximum"] == 128 and completion["logprobs"]["anyOf"][0]["maximum"] == 20
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == [
        "system",
        "user",
        "assistant",
        "tool",
        "function",
        "developer",
    ]
    operation = doc["paths"]["/v1/completions"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("CompletionRequest")
    statuses = {"200", "400", "404", "413", "500", "503"} | ({"502"} if server.routed else set())
    assert set(operation["responses"]) == statuses  # 400, not FastAPI's 422
    assert "HTTPValidationError" not in schemas


def test_schemathesis_fuzzing_finds_no_5xx_and_leaves_no_blocks(server):
    """Every operation of /openapi.json, with bodies that fit the schema and bodies that break it: no 5xx, the
    status codes and content types the document declares, error bodies in OpenAI's shape."""
    base = server.base_url
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    session = requests.Session()
    session.trust_env = False
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    statuses: dict[str, dict[int, int]] = {}

    def fuzz(operation, mode: GenerationMode) -> None:
        seen = statuses.setdefault(f"{operation.label} {mode.value}", {})

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
        )
        def run(case):
            response = case.call_and_validate(base_url=base, session=session, checks=checks, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1

        run()

    for result in schema.get_all_operations():
        operation = result.ok()
        fuzz(operation, GenerationMode.POSITIVE)
        if operation.method == "post":  # the GET endpoints take no input to break
            fuzz(operation, GenerationMode.NEGATIVE)
    # the fuzzing reached the engine (some 200s: generation ran) and its validation (400s)
    generated = [statuses[f"POST {path} positive"].get(200, 0) for path in ("/v1/completions", "/v1/chat/completions")]
    assert sum(generated) > 0, statuses
    assert statuses["POST /v1/completions negative"] == {400: 25}, statuses
    stats = server.wait_idle()
    assert stats["used_blocks"] == 0 and stats["requests_in_flight"] == 0 and stats["healthy"]
    assert session.get(f"{base}/health").status_code == 200
