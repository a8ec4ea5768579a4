"""The hand-off over HTTP inside one process: a prefill server, a decode server (one rank each) and the router;
completions and chat through the router continue exactly as HF, and the handle and stats say what happened."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from engine.core.startup import start_engine
from engine.kv_transfer.handles import KVRole
from engine.plan.checks import resolve_plan
from engine.serving.background import SERVER_KEEP_ALIVE_S, bind_socket
from engine.serving.hosting import start_server
from engine.serving.router import Router, start_router
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, write_plan

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_models):
    tmp = tmp_path_factory.mktemp("pd")
    folder = tiny_models("llama")
    prefill_plan = write_plan(tmp, folder, {"cache.block_size": 16}, name="prefill.yaml")
    decode_plan = write_plan(tmp, folder, {"cache.block_size": 8, "parallel.interleave": 4}, name="decode.yaml")
    prefill = start_server(start_engine(resolve_plan(prefill_plan), kv_role=KVRole("prefill", lease_s=60)), "tiny")
    prefill_url = f"http://127.0.0.1:{prefill.port}"
    role = KVRole("decode", transfer_timeout_s=10, prefill_url=prefill_url)
    decode = start_server(start_engine(resolve_plan(decode_plan), kv_role=role), "tiny")
    router = start_router(Router(prefill_url, f"http://127.0.0.1:{decode.port}"), bind_socket("127.0.0.1", 0))
    with httpx.Client(base_url=f"http://127.0.0.1:{router.port}", timeout=120, trust_env=False) as client:
        yield folder, client, prefill, decode
    router.stop()
    decode.stop()
    prefill.stop()


def completion(client, prompt, **kw):
    body = {
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **kw,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_through_the_router_are_hf_greedy(deployment):
    folder, client, _, _ = deployment
    prompts = prompt_ids(5, [1, 3, 17, 40, 70], seed=8)
    for ids in prompts:
        body = completion(client, ids)
        choice = body["choices"][0]
        tokens, logprobs = hf_greedy(folder, ids, NEW_TOKENS)
        assert choice["token_ids"] == tokens and choice["prompt_token_ids"] == ids
        assert (
            max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], logprobs, strict=True)) < LOGPROB_TOL
        )
        (kv,) = body["kv_transfer"]
        assert kv["tokens"] == len(ids) - 1 and kv["prefill_s"] > 0 and kv["claim_s"] > 0
        assert kv["transfer_s"] >= 0 and kv["first_decode_s"] > 0 and kv["queue_s"] >= 0
        assert (kv["descriptors"] > 0) == (len(ids) > 1)


def test_streaming_several_prompts_and_chat(deployment):
    folder, client, _, _ = deployment
    prompts = prompt_ids(3, [9, 30, 2], seed=9)
    body = completion(client, prompts)
    for ids, choice in zip(prompts, sorted(body["choices"], key=lambda c: c["index"]), strict=True):
        assert choice["token_ids"] == hf_greedy(folder, ids, NEW_TOKENS)[0]
    assert len(body["kv_transfer"]) == 3
    with client.stream(
        "POST",
        "/v1/completions",
        json={"prompt": prompts[1], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True},
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"kv_transfer"' in events[-2]
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["kv_transfer"][0]["tokens"] > 0


def test_bad_handles_straight_to_the_decode_instance_are_400(deployment):
    _, client, prefill, decode = deployment
    url = f"http://127.0.0.1:{decode.port}/v1/completions"
    engine_id = client.get("/v1/engine/stats").json()["prefill"]["engine_id"]
    cases = {
        "not a handle": {"hello": 1},
        "forged id": {"do_remote_prefill": True, "remote_engine_id": engine_id, "remote_request_id": "a" * 32},
        "foreign engine": {"do_remote_prefill": True, "remote_engine_id": "b" * 32, "remote_request_id": "a" * 32},
        "malformed": {"do_remote_prefill": True, "remote_engine_id": 5, "remote_request_id": "x"},
    }
    for name, params in cases.items():
        response = httpx.post(url, json={"prompt": [5, 6, 7], "kv_transfer_params": params}, timeout=30)
        assert response.status_code == 400, (name, response.text)
        assert "kv_transfer_params" in response.json()["error"]["message"], name
    # a real handle used twice: the second claim finds it released
    p = httpx.post(
        f"http://127.0.0.1:{prefill.port}/v1/completions",
        timeout=30,
        json={"prompt": [5, 6, 7], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    handle = p.json()["kv_transfer_params"]
    assert handle["do_remote_prefill"] is True and handle["remote_engine_id"] == engine_id
    first = httpx.post(url, json={"prompt": [5, 6, 7], "max_tokens": 2, "kv_transfer_params": handle}, timeout=30)
    assert first.status_code == 200, first.text
    again = httpx.post(url, json={"prompt": [5, 6, 7], "max_tokens": 2, "kv_transfer_params": handle}, timeout=30)
    assert again.status_code == 400 and "unknown or expired" in again.json()["error"]["message"]
    other = httpx.post(
        f"http://127.0.0.1:{prefill.port}/v1/completions",
        timeout=30,
        json={"prompt": [5, 6, 7], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    wrong = httpx.post(
        url, json={"prompt": [5, 6, 8], "kv_transfer_params": other.json()["kv_transfer_params"]}, timeout=30
    )
    assert wrong.status_code == 400 and "another prompt" in wrong.json()["error"]["message"]


def settled_stats(client, timeout_s=10.0) -> dict:
    """The router's stats once both instances hold no blocks and no exports (releases run in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.get("/v1/engine/stats").json()
        idle = stats["used_blocks"] == 0 and stats["prefill"]["exports_live"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_stats_after_the_requests_show_nothing_held(deployment):
    _, client, _, _ = deployment
    stats = settled_stats(client)
    assert stats["used_blocks"] == 0 and stats["kv_transfer"]["pulls"] > 0
    assert stats["prefill"]["used_blocks"] == 0 and stats["prefill"]["exports_live"] == 0
    assert stats["router"]["handed_off"] >= 3 and stats["router"]["healthy"] == {"prefill": True, "decode": True}
    assert client.get("/health").status_code == 200


def _get_health(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            return answer
        answer += chunk
    return answer


def test_idle_connections_outlast_a_client_pools_keep_alive(deployment):
    """Issue 33's reset: a server that closes an idle connection no later than its client's pool drops it (httpx: 5
    s, uvicorn's default: 5 s) races the client's next request on it, which then meets "connection reset by peer".
    The router and the instances keep an idle connection well beyond common pools' expiry: one idle for longer than
    httpx's still serves a request."""
    _, client, prefill, _ = deployment
    pool_expiry = httpx.Limits().keepalive_expiry
    ports = [int(str(client.base_url).rsplit(":", 1)[1]), prefill.port]
    sockets = [socket.create_connection(("127.0.0.1", port)) for port in ports]
    try:
        for sock in sockets:
            assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(pool_expiry + 1)
        for sock, port in zip(sockets, ports, strict=True):
            assert _get_health(sock).startswith(b"HTTP/1.1 200"), f"port {port} closed the idle connection"
    finally:
        for sock in sockets:
            sock.close()
    assert SERVER_KEEP_ALIVE_S > 60  # more than aiohttp's 15 s and a cloud load balancer's 60 s too
