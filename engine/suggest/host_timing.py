"""The host work of the engine's decode step, timed on a tiny checkpoint whose step is all host work (Python, op
dispatch, small ops): in this process alone (`host_seconds_per_layer`), as two real ranks of a dcp 2 layout
(`two_rank_step_seconds`) and served by the engine's own server to concurrent streams (`served_step_seconds`)."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.suggest.kernel_timing import BLOCK_SIZE, DECODE_ROWS, ELEMENT_BYTES, timed_passes

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.plan.resolved import ResolvedPlan

HOST_CONTEXT = 16  # cached tokens per sequence of the host timing: too few for the attention to count
HOST_REPEATS = 30
SERVED_TOKENS = 32  # tokens each request of the served timing decodes


def _host_plan(folder: Path, dcp: int) -> ResolvedPlan:
    """The resolved tp 1 / `dcp` plan the host timings run on the (tiny) checkpoint in `folder`."""
    from engine.plan.checks import check_plan
    from engine.plan.loader import LoadedPlan
    from engine.plan.schema import Plan

    plan = Plan(name="host_timing")
    plan.model.path, plan.model.dtype, plan.model.max_model_len = str(folder), "float32", 4 * BLOCK_SIZE
    plan.parallel.dcp = dcp
    plan.cache.block_size, plan.cache.memory = BLOCK_SIZE, "16MiB"
    plan.launch.device, plan.attention.backend = "cpu", "cpu"
    return check_plan(LoadedPlan(plan=plan, source=Path("host_timing.yaml")), devices_here=False).require_valid()


def _decode_step_seconds(engine: LLMEngine, rows: int) -> float:
    """Median seconds of `engine`'s decode step of `rows` greedy sequences of `HOST_CONTEXT` cached tokens."""
    from engine.core.sequence import SamplingParams

    params = SamplingParams(max_tokens=2 * HOST_REPEATS, temperature=0.0, ignore_eos=True)
    for seq in range(rows):
        engine.add_request([seq + 1] * HOST_CONTEXT, params)
    engine.step()  # the prompts' prefill; every step after it decodes all `rows` sequences
    return statistics.median(timed_passes(engine.step, HOST_REPEATS))


def host_seconds_per_layer(folder: Path, dcp: int, layers: int, rows: int = DECODE_ROWS) -> float:
    """Median seconds per layer of the engine's decode step (`LLMEngine.step`: schedule, run, sample, detokenize)
    of `rows` greedy sequences on rank 0 of a tp 1 / `dcp` plan of the (tiny) checkpoint in `folder`, run in this
    process alone, with the threads the engine gives each of the plan's ranks on this node."""
    import torch

    from engine import devices
    from engine.attention.registry import create_backend
    from engine.checkpoints.config_values import read_config
    from engine.core.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.distributed import init_single
    from engine.runtime.model_runner import CacheLayout, ModelRunner

    res = _host_plan(folder, dcp)
    config = EngineConfig.from_plan(res)
    torch.set_num_threads(max(1, devices.cpu_cores() // config.local_world_size))
    par = init_single(config.placement, torch.device("cpu"))
    hf_config = read_config(folder)
    runner = ModelRunner(hf_config, folder, par, torch.float32, create_backend(res.backend), config.max_model_len)
    runner.allocate_cache(CacheLayout(config.num_blocks, BLOCK_SIZE, 1, torch.float32))
    return _decode_step_seconds(LLMEngine(config, par, runner), rows) / layers


def _two_rank_worker(rank: int, folder: str, port: int, out: str, rows: int) -> None:
    """One rank of the two-rank step timing: both start the engine as the launcher's ranks do (`start_engine`);
    rank 0 drives the steps and writes its median step's seconds to `out`, rank 1 follows them."""
    import torch.distributed as dist

    from engine.core.startup import start_engine

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    engine = start_engine(_host_plan(Path(folder), 2))
    if engine is not None:
        seconds = _decode_step_seconds(engine, rows)
        engine.shutdown()
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def two_rank_step_seconds(folder: Path, rows: int = DECODE_ROWS) -> float:
    """Median seconds of rank 0's decode step of `rows` greedy sequences of a
    tp 1 / dcp 2 plan of the (tiny) checkpoint in `folder`, run as two ranks of this node: real torch.distributed
    (gloo, and the shared-memory collectives `launch.cpu_comm: auto` gives local ranks), a rank per core."""
    import torch.multiprocessing as mp

    from engine.runtime.launcher import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        mp.start_processes(
            _two_rank_worker, args=(str(folder), free_port(), str(out), rows), nprocs=2, start_method="spawn"
        )
        return json.loads(out.read_text())


def _streamed_token_times(url: str, seq: int, tokens: int) -> list[float]:
    """Arrival times of the streamed chunks (one a step) of one greedy /v1/completions request."""
    import httpx

    body = {"prompt": [seq + 1] * HOST_CONTEXT, "max_tokens": tokens, "temperature": 0.0, "stream": True}
    body["ignore_eos"] = True
    times = []
    with httpx.Client(timeout=300.0, trust_env=False) as client, client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else "[DONE]"
            if data != "[DONE]" and json.loads(data).get("choices"):
                times.append(time.perf_counter())
    return times


def served_step_seconds(folder: Path, rows: int = DECODE_ROWS) -> float:
    """Median gap between the streamed tokens of `rows` concurrent greedy requests of `HOST_CONTEXT` prompt tokens
    to the engine's own server of the one-rank plan of the (tiny) checkpoint in `folder` (a subprocess, as
    `dcpctl run` serves it: uvicorn's event loop and the engine thread in one process), read by a client in this
    process (as `dcpctl bench` reads one): the decode step as served, the server's work per token included."""
    from concurrent.futures import ThreadPoolExecutor

    import yaml

    from engine.plan.loader import plan_to_dict
    from engine.serving.plan_server import PlanServer

    plan_file = folder.parent / "serve_timing.yaml"
    plan_file.write_text(yaml.safe_dump(plan_to_dict(_host_plan(folder, 1).plan)))
    with PlanServer(plan_file, log_path=folder.parent / "serve_timing.log") as server:
        url = f"{server.base_url}/v1/completions"
        with ThreadPoolExecutor(rows) as pool:
            streams = list(pool.map(lambda seq: _streamed_token_times(url, seq, SERVED_TOKENS), range(rows)))
    # from the third token on: every request has had its prefill by then, and each gap is one step of all `rows`
    return statistics.median(b - a for times in streams for a, b in itertools.pairwise(times[2:]))


def step_collectives(folder: Path, dcp: int) -> int:
    """Collectives per decode step (every layer's and the step's own) the suggestion charges a tp 1 / `dcp` plan
    of the checkpoint in `folder` (`engine.placement.collectives`)."""
    from engine.placement.collectives import collectives

    items = collectives(_host_plan(folder, dcp).placement, ELEMENT_BYTES)
    return sum(len(c.layers) if c.layers is not None else 1 for c in items)
