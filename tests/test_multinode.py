"""Multi-node runs on this machine: node 0 and node 1 as separate `dcpctl run` processes over loopback (gloo between
them: `launch.cpu_comm=auto` picks it for launch.nnodes > 1), greedy tokens equal to HF's for the replica and in-TP
DCP layouts, whichever node starts first; a P/D pair whose prefill, decode and router are started separately with
`--role` and pointed at each other's URLs; and the faults: a node never started fails the other within the
rendezvous timeout with one line saying what to start, and a node killed mid-run ends the other with the cause."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.plan.schema import LaunchSection
from engine.runtime.launcher import _root_error, free_port
from engine.serving.plan_server import PlanServer
from tests.oracle import hf_greedy, prompt_ids, read_jsonl, write_plan
from tests.test_pd import assert_hf, complete_all, pd_plan, settled

NEW_TOKENS = 12
RDZV_TIMEOUT_S = 5  # the never-started node's tests wait this long (torchrun's default is 600)
LAYOUTS = {
    # tp1/dcp2 of a model with 2 KV heads: the second rank is a replica of the TP group holding half the KV cache
    "replica": ("llama", {}, {"parallel.tp": 1, "parallel.dcp": 2}),
    # MLA tp2/dcp2: DCP reuses the TP ranks
    "in-tp": ("deepseek_v2", {}, {"parallel.tp": 2, "parallel.dcp": 2}),
}


def node_command(plan: Path, node_rank: int, port: int, *args: str) -> list[str]:
    """`dcpctl run PLAN` as node `node_rank` of two, with the rendezvous at 127.0.0.1:port."""
    overrides = ["launch.nnodes=2", f"launch.node_rank={node_rank}", f"launch.master_port={port}"]
    return [sys.executable, "-m", "dcpctl.cli", "run", str(plan), *overrides, *args]


def start_node(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(node: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """Wait for a node: its exit code, its stderr (whitespace collapsed) and how long the wait took."""
    started = time.monotonic()
    _, err = node.communicate(timeout=timeout)
    return node.returncode, " ".join(err.split()), time.monotonic() - started


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a whole node: its dcpctl, torchrun and ranks (torchrun starts each rank in a session of its own)."""
    with contextlib.suppress(psutil.Error):
        for process in [*psutil.Process(node.pid).children(recursive=True), psutil.Process(node.pid)]:
            with contextlib.suppress(psutil.Error):
                process.kill()
    node.wait()


def prompts_file(tmp_path: Path, prompts: list[list[int]]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    return path


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("layout", "first"), [("replica", 0), ("in-tp", 1)])
def test_two_nodes_match_hf(tmp_path, tiny_models, layout, first):
    """Both nodes exit 0 and node 0's tokens are HF's; the in-TP case starts node 1 first (it waits for node 0's
    rendezvous) and node 0 a few seconds later."""
    arch, sizes, settings = LAYOUTS[layout]
    folder = tiny_models(arch, **sizes)
    plan = write_plan(tmp_path, folder, settings)
    prompts = prompt_ids(3, [1, 17, 40], seed=5)
    jobs = ["--prompts-file", str(prompts_file(tmp_path, prompts)), "--max-tokens", str(NEW_TOKENS), "--ignore-eos"]
    out = tmp_path / "out.jsonl"
    port = free_port()
    commands = {0: node_command(plan, 0, port, *jobs, "--output", str(out)), 1: node_command(plan, 1, port, *jobs)}
    nodes = {first: start_node(commands[first])}
    try:
        time.sleep(3)
        nodes[1 - first] = start_node(commands[1 - first])
        results = {rank: finish(node, timeout=300) for rank, node in nodes.items()}
    finally:
        for node in nodes.values():
            kill_node(node)
    for rank, (code, err, _) in results.items():
        assert code == 0, f"node {rank}: {err[-3000:]}"
    assert "collectives: gloo" in results[0][1]
    for ids, record in zip(prompts, read_jsonl(out), strict=True):
        assert record["token_ids"] == hf_greedy(folder, ids, NEW_TOKENS)[0], f"prompt of {len(ids)} tokens"


@pytest.mark.multiproc
@pytest.mark.parametrize("started", [0, 1])
def test_a_node_never_started_fails_the_other_in_one_line(tmp_path, tiny_models, started):
    """Only one of the two nodes is started: it ends within the rendezvous timeout (torch's store client retries
    once: up to about three times it for a node waiting on node 0) with one line that says which nodes to start."""
    plan = write_plan(tmp_path, tiny_models("llama"), {"parallel.dcp": 2})
    port = free_port()
    node = start_node(node_command(plan, started, port, f"launch.rdzv_timeout_s={RDZV_TIMEOUT_S}", "--prompt", "hi"))
    try:
        code, err, _took = finish(node, timeout=RDZV_TIMEOUT_S * 3 + 60)
    finally:
        kill_node(node)
    assert code == 1 and "Traceback" not in err
    if started == 0:
        want = (
            f"error: the run failed: node 0 waited launch.rdzv_timeout_s={RDZV_TIMEOUT_S} s for the other nodes "
            f"at 127.0.0.1:{port} and 1 of 2 joined; start every node with launch.nnodes=2, its own "
            "launch.node_rank and the same launch.master_addr and launch.master_port (full log: "
        )
    else:
        want = (
            f"error: the run failed: node 1 found no node 0 at 127.0.0.1:{port} within "
            f"launch.rdzv_timeout_s={RDZV_TIMEOUT_S} s; start node 0 (launch.node_rank=0) there, or point "
            "launch.master_addr and launch.master_port at it (full log: "
        )
    assert err.startswith(want), err


@pytest.mark.slow
@pytest.mark.multiproc
def test_node_1_killed_mid_run_ends_node_0_with_the_cause(tmp_path, tiny_models):
    """SIGKILL of node 1 (its dcpctl, torchrun and rank) while both generate: node 0 ends with exit code 1 in a
    few seconds, its one line naming the rank that went away and where it ran."""
    settings = {"parallel.dcp": 2, "model.max_model_len": 2048, "cache.memory": "64MiB"}
    plan = write_plan(tmp_path, tiny_models("llama"), settings)
    prompts = prompt_ids(16, [20] * 16, seed=6)  # 32k tokens: tens of seconds on two cores
    jobs = ["--prompts-file", str(prompts_file(tmp_path, prompts)), "--max-tokens", "2000", "--ignore-eos"]
    stats = tmp_path / "stats"
    env = {"DCPCTL_RANK_STATS_DIR": str(stats)}
    port = free_port()
    nodes = [start_node(node_command(plan, rank, port, *jobs), env) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while len(list(stats.glob("rank*.json"))) < 2:
            assert all(node.poll() is None for node in nodes) and time.monotonic() < deadline, "the ranks never ran"
            time.sleep(0.2)
        time.sleep(1.0)  # generating
        kill_node(nodes[1])
        code, err, took = finish(nodes[0], timeout=120)
    finally:
        for node in nodes:
            kill_node(node)
    assert code == 1 and "Traceback" not in err and took < 30
    cause = r"error: the run failed: node 1 went away \(rank 0 lost its peer at 127\.0\.0\.1:\d+: "
    assert re.search(cause + r"Connection (reset|closed) by peer\); that node's own log says why \(full log: ", err)


def pd_role(plan: Path, role: str, port_key: str, port: int, overrides: list[str], tmp_path: Path) -> PlanServer:
    """One piece of a P/D deployment as its own server (`--role`), as on a node of its own."""
    return PlanServer(
        plan, overrides, port=port, port_key=port_key, args=["--role", role], log_path=tmp_path / f"{role}.log"
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_pd_pieces_started_separately_match_hf(tmp_path, tiny_models):
    """The prefill instance, the decode instance (tp1/dcp2, two ranks) and the router, each its own server started
    with --role and given the others' URLs (as one per node): greedy tokens through the router are HF's, and
    afterwards neither instance holds a block or an export."""
    folder = tiny_models("llama")
    plan = pd_plan(
        tmp_path, folder, {"cache.block_size": 8}, {"parallel.dcp": 2, "parallel.interleave": 8, "cache.block_size": 8}
    )
    ports = {role: free_port() for role in ("prefill", "decode", "router")}
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    prefill = pd_role(plan, "prefill", "disagg.prefill_port", ports["prefill"], [], tmp_path)
    decode = pd_role(
        plan, "decode", "disagg.decode_port", ports["decode"], [f"disagg.prefill_url={urls['prefill']}"], tmp_path
    )
    router = pd_role(
        plan,
        "router",
        "serve.port",
        ports["router"],
        [f"disagg.prefill_url={urls['prefill']}", f"disagg.decode_url={urls['decode']}"],
        tmp_path,
    )
    prompts = prompt_ids(4, [1, 9, 33, 70], seed=8)
    with prefill, decode, router:
        bodies = complete_all(router.base_url, prompts)
        assert_hf(folder, prompts, bodies)
        settled(router.base_url)


def _records(folder: Path, *messages: str) -> Path:
    folder.mkdir()
    for rank, message in enumerate(messages):
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "time": float(rank), "message": message}))
    return folder


def test_root_error_of_a_multi_node_run(tmp_path):
    """What node 0 says when the ranks here only lost peers on another node, and when the nodes never met."""
    two_nodes = LaunchSection(nnodes=2, node_rank=0, master_port=29500, rdzv_timeout_s=5)
    reset = "RuntimeError: [pair.cc:537] Read error [10.0.0.2]:5308: Connection reset by peer. GLHF!"
    folder = _records(tmp_path / "lost", reset)
    assert _root_error(folder, "", two_nodes) == (
        "node 1 went away (rank 0 lost its peer at 10.0.0.2:5308: Connection reset by peer); "
        "that node's own log says why"
    )
    three = LaunchSection(nnodes=3, node_rank=2, master_port=29500)
    assert _root_error(folder, "", three).startswith("a rank on another node went away (rank 0 lost its peer at ")
    assert _root_error(folder, "", LaunchSection()) == f"rank 0: {reset}"  # one node: the rank's own words
    no_ranks = tmp_path / "none"
    no_ranks.mkdir()
    store = "torch.distributed.DistStoreError: Timed out after 6 seconds waiting for clients. 1/2 clients joined."
    assert _root_error(no_ranks, store, two_nodes).startswith(
        "node 0 waited launch.rdzv_timeout_s=5 s for the other nodes at 127.0.0.1:29500 and 1 of 2 joined; "
    )
    endpoint = LaunchSection(nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_timeout_s=5)
    assert _root_error(no_ranks, "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", endpoint) == (
        "not all launch.nnodes=2 nodes joined the rendezvous at 10.0.0.1:29400 within launch.rdzv_timeout_s=5 s; "
        "start every node with the same launch.rdzv_endpoint"
    )


def test_the_rendezvous_timeout_reaches_torchrun_and_is_checked(tmp_path, llama_folder):
    from engine.errors import UserError
    from engine.plan.checks import resolve_plan
    from engine.runtime.launcher import torchrun_command

    static = torchrun_command(LaunchSection(nnodes=2, master_port=29500, rdzv_timeout_s=7), 1, [], tmp_path)
    assert "--rdzv-conf=timeout=7" in static
    c10d = torchrun_command(LaunchSection(nnodes=2, rdzv_endpoint="h:1", rdzv_timeout_s=7), 1, [], tmp_path)
    assert "--rdzv-conf=join_timeout=7" in c10d
    plan = write_plan(tmp_path, llama_folder)
    with pytest.raises(UserError, match=r"launch\.rdzv_timeout_s=0 must be >= 1 \(seconds\)"):
        resolve_plan(str(plan), ["launch.rdzv_timeout_s=0"])
