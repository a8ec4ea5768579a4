"""Prefill -> decode hand-off across DCP layouts, for real: `python -m engine.serve_entry PD_PLAN` starts the
prefill instance, the decode instance (each under torchrun when it has several ranks) and the router; greedy tokens
and logprobs through the router equal HF's, with prompts of every awkward length in flight together, a decode side
that hits its prefix cache or preempts; afterwards neither side holds a block or an export."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import signal
import time

import httpx
import pytest
import yaml

from engine import dcp
from engine.kv_transfer import transport
from engine.parallel_layout import ParallelLayout
from engine.serving.background import bind_socket
from engine.serving.deployment import Deployment
from engine.serving.plan_server import PlanServer
from engine.serving.router import start_router
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, write_plan
from tests.test_dcp_equivalence import dcpctl_run
from tests.test_kv_scales import MLA_SCALES

pytestmark = pytest.mark.multiproc

LENGTHS = [1, 2, 3, 31, 33, 47, 100, 130]  # not multiples of B or I, shorter than a virtual block, several blocks
NEW_TOKENS = 6


def pd_plan(tmp_path, folder, prefill: dict, decode: dict, disagg: dict | None = None):
    """A prefill plan and a P/D decode plan naming it (tiny test settings)."""
    write_plan(tmp_path, folder, prefill, name="prefill.yaml")
    path = write_plan(tmp_path, folder, decode, name="pd.yaml")
    data = yaml.safe_load(path.read_text())
    data["disagg"] = {"prefill": "prefill.yaml", "transfer_timeout_s": 20, **(disagg or {})}
    path.write_text(yaml.safe_dump(data))
    return path


async def _complete_all(url: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300, trust_env=False) as client:

        async def one(ids):
            body = {
                "prompt": ids,
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_token_ids": True,
            }
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        return list(await asyncio.gather(*(one(ids) for ids in prompts)))


def complete_all(url: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[dict]:
    """Every prompt through the router at once."""
    return asyncio.run(_complete_all(url, prompts, new_tokens))


def assert_hf(folder, prompts, bodies, new_tokens=NEW_TOKENS):
    for ids, body in zip(prompts, bodies, strict=True):
        choice = body["choices"][0]
        tokens, logprobs = hf_greedy(folder, ids, new_tokens)
        assert choice["token_ids"] == tokens, f"prompt of {len(ids)} tokens diverged"
        ours = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < LOGPROB_TOL


def settled(url: str, timeout_s: float = 20.0) -> dict:
    """The router's stats once neither instance holds a block or an export (releases run in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{url}/v1/engine/stats", timeout=10, trust_env=False).json()
        if stats["used_blocks"] == 0 and stats["prefill"]["exports_live"] == 0 and stats["prefill"]["used_blocks"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def assert_one_descriptor_per_block(folder, plan, prompts, bodies, element_bytes: int = 4) -> None:
    """Interleave = block size from a dcp-1 prefill side: every decode rank's pull is exactly one descriptor per
    block it fills (each request's own report; the cache is block-major, so a block of all layers and K/V is one
    range), and as many blocks' bytes."""
    config = json.loads((folder / "config.json").read_text())
    mla = "kv_lora_rank" in config
    settings = yaml.safe_load(plan.read_text())
    par, block_size = settings["parallel"], settings["cache"]["block_size"]
    assert par["interleave"] == block_size
    heads = config["num_attention_heads"]
    layout = ParallelLayout.build(par["tp"], par["dcp"], heads, config.get("num_key_value_heads", heads), mla)
    per_block = config["num_hidden_layers"] * (1 if mla else 2)  # layers x K/V
    head_dim = config["kv_lora_rank"] + config["qk_rope_head_dim"] if mla else config["head_dim"]
    block_bytes = layout.kv_heads_per_rank() * block_size * head_dim * element_bytes  # float32 unless told
    for ids, body in zip(prompts, bodies, strict=True):
        (kv,) = body["kv_transfer"]
        ranks = {r["rank"]: r for r in kv["per_rank"]}
        assert sorted(ranks) == list(range(layout.world_size))
        for rank, report in ranks.items():
            local = dcp.local_len(len(ids) - 1, layout.role(rank).dcp_rank, block_size, par["dcp"])
            blocks = math.ceil(local / block_size)
            assert report["descriptors"] == blocks, (len(ids), rank, report)
            assert report["bytes"] == blocks * per_block * block_bytes  # whole blocks (the last one stretched)


def check_deployment(tmp_path, folder, plan, seed=0) -> dict:
    """The matrix for one P/D plan: every length at once vs HF, then the same prompt again (a prefix hit on the
    decode side pulls less), then nothing held. At interleave = block size, the descriptor counts are exact."""
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=seed)
    with PlanServer(plan, log_path=tmp_path / "pd.log", health_timeout_s=300) as server:
        bodies = complete_all(server.base_url, prompts)
        assert_hf(folder, prompts, bodies)
        for ids, body in zip(prompts, bodies, strict=True):
            (kv,) = body["kv_transfer"]
            assert kv["tokens"] == len(ids) - 1
        settings = yaml.safe_load(plan.read_text())
        if settings["parallel"]["interleave"] == settings["cache"]["block_size"]:
            assert_one_descriptor_per_block(folder, plan, prompts, bodies)
        again = complete_all(server.base_url, [prompts[-1]])
        assert again[0]["choices"][0]["token_ids"] == bodies[-1]["choices"][0]["token_ids"]
        assert again[0]["kv_transfer"][0]["tokens"] < len(prompts[-1]) - 1  # the decode side's prefix cache
        return settled(server.base_url)


@pytest.mark.parametrize("interleave", [1, 16])
def test_mla_tp1_dcp1_to_tp2_dcp2(tmp_path, tiny_models, interleave):
    folder = tiny_models("deepseek_v2")
    plan = pd_plan(
        tmp_path,
        folder,
        {"cache.block_size": 16},
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": interleave, "cache.block_size": 16},
    )
    stats = check_deployment(tmp_path, folder, plan)
    assert stats["kv_transfer"]["pulls_failed"] == 0 and len(stats["kv_transfer"]["ranks"]) == 2


def test_gqa_tp2_dcp1_to_tp2_dcp2_replicas(tmp_path, tiny_models):
    folder = tiny_models("llama")  # 4 heads, 2 KV heads: tp2 holds one KV head per rank; dcp2 adds replica ranks
    plan = pd_plan(
        tmp_path,
        folder,
        {"parallel.tp": 2, "cache.block_size": 8},
        {"parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 8, "cache.block_size": 8},
    )
    stats = check_deployment(tmp_path, folder, plan, seed=1)
    assert len(stats["kv_transfer"]["ranks"]) == 4


def test_dcp2_to_dcp2_with_other_interleave_and_block_and_a_preempting_decode_side(tmp_path, tiny_models):
    folder = tiny_models("llama")
    # decode cache: 2 layers x 2 x 2 KV heads x 16 x 4 B = 512 B/token per rank; 48 KiB = 96 tokens per rank,
    # 192 per sequence over dcp 2: the 8 prompts cannot all stay, so some are preempted and recomputed there
    plan = pd_plan(
        tmp_path,
        folder,
        {"parallel.dcp": 2, "parallel.interleave": 4, "cache.block_size": 8},
        {
            "parallel.dcp": 2,
            "parallel.interleave": 16,
            "cache.block_size": 16,
            "cache.memory": "48KiB",
            "model.max_model_len": 180,
        },
    )
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=2)
    with PlanServer(plan, log_path=tmp_path / "pd.log", health_timeout_s=300) as server:
        bodies = complete_all(server.base_url, prompts, new_tokens=40)
        assert_hf(folder, prompts, bodies, new_tokens=40)
        stats = settled(server.base_url)
    assert stats["preemptions"] > 0 and stats["kv_transfer"]["pulls"] == len(LENGTHS)


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)
    return value


def fault_plan(tmp_path, folder, disagg: dict | None = None):
    """The fault tests' P/D plan: prefill dcp1 -> decode dcp2 at interleave = block size = 8."""
    prefill, decode = {"cache.block_size": 8}, {"parallel.dcp": 2, "parallel.interleave": 8, "cache.block_size": 8}
    return pd_plan(tmp_path, folder, prefill, decode, disagg)


@contextlib.contextmanager
def routed(tmp_path, folder, disagg: dict):
    """The fault tests' deployment with a router in this process; yields (deployment, router URL, client)."""
    plan = fault_plan(tmp_path, folder, disagg)
    with Deployment(str(plan), "pd", [], 0, 0) as deployment:
        router = start_router(deployment.router(), bind_socket("127.0.0.1", 0))
        try:
            with httpx.Client(timeout=60, trust_env=False) as client:
                yield deployment, f"http://127.0.0.1:{router.port}", client
        finally:
            router.stop()


def assert_router_reports(client: httpx.Client, url: str, role: str, instance_url: str, body: dict) -> None:
    """The router's /health turns 503 naming the instance, and a request is refused at once, naming it."""
    health = wait_for(lambda: (r := client.get(f"{url}/health")).status_code == 503 and r, what="router 503")
    assert f"the {role} instance {instance_url} is unhealthy" in health.text
    refused = client.post(f"{url}/v1/completions", json=body)
    assert refused.status_code == 503 and f"the {role} instance {instance_url}" in refused.text, refused.text


def test_faults_expired_stale_and_a_dead_prefill_instance(tmp_path, tiny_models):
    """Real processes: an export nobody claims is freed when its lease ends and its handle is then stale (400); the
    prefill instance killed: a handle it gave out fails at the decode side naming it (502, no hang), the router
    reports it unhealthy and answers at once, and the decode side holds no block."""
    folder = tiny_models("llama")
    ids = prompt_ids(1, [40], seed=5)[0]
    export = {"prompt": ids, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    with routed(tmp_path, folder, {"lease_s": 3, "transfer_timeout_s": 1}) as (deployment, url, client):
        p_url, d_url = deployment.prefill.base_url, deployment.decode.base_url

        def stats(base):
            return client.get(f"{base}/v1/engine/stats").json()

        handle = client.post(f"{p_url}/v1/completions", json=export).json()["kv_transfer_params"]
        assert stats(p_url)["exports_live"] == 1
        wait_for(lambda: stats(p_url)["exports_live"] == 0 and stats(p_url)["used_blocks"] == 0, what="expiry")
        body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        stale = client.post(f"{d_url}/v1/completions", json={**body, "kv_transfer_params": handle})
        assert stale.status_code == 400 and "expired" in stale.text, stale.text
        # the router sets kv_transfer_params itself: a client's are refused, naming the field
        own = client.post(f"{url}/v1/completions", json={**body, "kv_transfer_params": handle})
        assert own.status_code == 400 and own.json()["error"]["param"] == "kv_transfer_params", own.text

        ok = client.post(f"{url}/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["token_ids"] == hf_greedy(folder, ids, 3)[0]

        handle = client.post(f"{p_url}/v1/completions", json=export).json()["kv_transfer_params"]
        os.killpg(deployment.prefill.pid, signal.SIGKILL)
        start = time.monotonic()
        dead = client.post(f"{d_url}/v1/completions", json={**body, "kv_transfer_params": handle})
        assert dead.status_code == 502 and f"the prefill instance {p_url}" in dead.text, dead.text
        assert time.monotonic() - start < 15
        assert stats(d_url)["used_blocks"] == 0
        failed = client.post(f"{url}/v1/completions", json=body)
        assert failed.status_code in (502, 503) and "prefill instance" in failed.text, failed.text
        assert_router_reports(client, url, "prefill", p_url, body)
        assert stats(d_url)["used_blocks"] == 0


def test_the_prefill_instance_killed_mid_transfer(tmp_path, tiny_models, monkeypatch):
    """The prefill instance SIGKILLed while a decode rank's READ is in flight (held there by the transport's test
    hook): the request fails with an error naming the prefill instance (no hang), the decode side frees its blocks
    and stays healthy, the router stays up, reports the prefill instance unhealthy and answers at once."""
    hold = tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv(transport.HOLD_ENV, str(hold))  # inherited by the decode ranks
    body = {"prompt": prompt_ids(1, [100], seed=7)[0], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with routed(tmp_path, tiny_models("llama"), {"transfer_timeout_s": 20}) as (deployment, url, client):
        p_url, d_url = deployment.prefill.base_url, deployment.decode.base_url
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.post, f"{url}/v1/completions", json=body)
            wait_for(lambda: list(hold.glob("reading-*")), what="a READ in flight")
            os.killpg(deployment.prefill.pid, signal.SIGKILL)
            deployment.prefill.proc.wait(timeout=10)
            start = time.monotonic()
            (hold / "go").touch()
            failed = pending.result(timeout=60)
        assert time.monotonic() - start < 30
        assert failed.status_code == 502, failed.text
        assert f"the KV transfer from the prefill instance {p_url} failed on decode rank" in failed.text
        wait_for(lambda: client.get(f"{d_url}/v1/engine/stats").json()["used_blocks"] == 0, what="no block used")
        stats = client.get(f"{d_url}/v1/engine/stats").json()["kv_transfer"]
        assert stats["pulls_failed"] == 1 and "READ from" in stats["last_error"]
        assert client.get(f"{d_url}/health").status_code == 200  # the decode side goes on
        assert_router_reports(client, url, "prefill", p_url, body)


def test_a_decode_rank_dying_ends_the_decode_instance_and_the_router_says_so(tmp_path, tiny_models):
    """Decode rank 1 SIGKILLed while a request generates: the request ends with an error (no hang), the decode
    instance exits with its root cause as any plan does, the router stays up, reports it unhealthy and answers at
    once, and the prefill side holds nothing."""
    body = {"prompt": prompt_ids(1, [20], seed=6)[0], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with routed(tmp_path, tiny_models("llama"), {"lease_s": 5, "transfer_timeout_s": 3}) as (deployment, url, client):
        p_url, d_url = deployment.prefill.base_url, deployment.decode.base_url
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.post, f"{url}/v1/completions", json=body)
            wait_for(lambda: client.get(f"{d_url}/v1/engine/stats").json()["generated_tokens"] > 0)
            (rank1,) = [
                p
                for p in deployment.decode.processes()
                if "engine.worker" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1"
            ]
            start = time.monotonic()
            rank1.send_signal(signal.SIGKILL)
            failed = pending.result(timeout=60)
        assert failed.status_code >= 500 and "error" in failed.json(), (
            failed.text
        )  # from the router or the dying instance
        assert time.monotonic() - start < 60
        assert deployment.decode.proc.wait(timeout=60) != 0
        assert "rank 1" in deployment.decode.exit_reason(), deployment.decode.exit_reason()
        assert_router_reports(client, url, "decode", d_url, {**body, "max_tokens": 2})
        wait_for(lambda: client.get(f"{p_url}/v1/engine/stats").json()["exports_live"] == 0, what="no export")


def test_fp8_hand_off_equals_the_colocated_fp8_plan(tmp_path, kv_scaled_models):
    """An fp8_e4m3 cache on both sides: the decode side pulls the prefill side's one-byte blocks (one descriptor per
    block at interleave = block size, a quarter of float32's bytes) and generates the colocated fp8 plan's tokens.
    The checkpoint carries per-layer scales of the latent cache: both sides store and read with the same ones (a P/D
    plan cannot calibrate its own: tests/test_kv_scales.py)."""
    folder = kv_scaled_models("deepseek_v2", MLA_SCALES)
    fp8 = {"cache.block_size": 16, "cache.dtype": "fp8_e4m3"}
    plan = pd_plan(tmp_path, folder, fp8, {**fp8, "parallel.tp": 2, "parallel.dcp": 2, "parallel.interleave": 16})
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=2)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    colocated = write_plan(tmp_path, folder, fp8, name="colocated.yaml")
    want, _ = dcpctl_run(colocated, prompts_file, tmp_path / "colocated.jsonl", tmp_path / "stats", NEW_TOKENS)
    with PlanServer(plan, log_path=tmp_path / "pd.log", health_timeout_s=300) as server:
        bodies = complete_all(server.base_url, prompts)
        assert_one_descriptor_per_block(folder, plan, prompts, bodies, element_bytes=1)
        for ids, body, record in zip(prompts, bodies, want, strict=True):
            choice = body["choices"][0]
            assert choice["token_ids"] == record["token_ids"], f"prompt of {len(ids)} tokens diverged"
            theirs = [lp["logprob"] for lp in record["logprobs"]]
            assert (
                max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], theirs, strict=True)) < LOGPROB_TOL
            )
        assert settled(server.base_url)["kv_transfer"]["pulls_failed"] == 0
