"""The engine's own decode work, timed on this CPU at a model's shapes (what the `cpu` roofline's figures are).

A decode step on CPU is the linear layers at a few rows, the paged decode attention over each sequence's cached
tokens, and the host work around them. Each is timed here with the engine's code, on one thread per core with every
core doing the same at once (a layout with a rank per core: its ranks share the memory system and the caches while
they run the same layers) and on one rank's threads over all cores (a lone rank, whose threads wait for each other
at every parallel region); each figure is the median of repeated passes (and, side by side, of the processes):

- linears: `engine.layers.linear.ReplicatedLinear`, packed as the engine packs it (GEMV or the GEMM `pack` picks),
  at `DECODE_ROWS` rows over each of the model's weight shapes (one decoder layer's projections and the LM head)
  -> matmul FLOP/s at the model's decode shapes, each shape weighted as the model's layers weigh it;
- attention: the CPU backend's paged decode (`CpuBackend.paged`) of `DECODE_ROWS` sequences of `DECODE_CONTEXT`
  tokens at the model's heads and head dims -> KV bytes read per second;
- host work: the engine's whole decode step (`LLMEngine.step`: schedule, inputs and attention metadata, every
  layer, the logits, greedy sampling, detokenizing) on a tiny random checkpoint of the model's architecture, depth
  and heads (`engine.checkpoints.tiny`: widths so small that the step is its host work: Python, op dispatch,
  small ops), for rank 0 of a one-rank layout and of a tp 1 / dcp 2 layout (its DCP combine and dense-layer splits
  included, the collectives themselves left out: one process runs rank 0 alone, and a group of one rank sends
  nothing), with the threads the engine gives such a rank on this node -> seconds per layer;
- serving: the same tiny one-rank plan served by the engine's own server (a subprocess, as `dcpctl run` serves it)
  to `DECODE_ROWS` concurrent streaming requests -> what its gap between tokens adds to the in-process step, per
  streamed token (the server's event loop and SSE work, which takes a core the step needs);
- the two ranks' interaction: the same tp 1 / dcp 2 step run as two real ranks (torch.distributed over gloo, the
  collectives `launch.cpu_comm: auto` gives them, rank 0's step plans over gloo, a rank per core) -> seconds per
  layer of rank 0's step, and what it adds to the step run alone, per collective of the layout (its collectives'
  latency inside a step: the wait for the peer, the peer's contention for the cores, the step plan's broadcast).

Each shape's weights (each layer's cache) are allocated in enough copies to fill `COLD_BYTES` and timed one copy
after the other, so that a pass reads them from memory, as a step reads a model larger than the caches.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoints.model_info import ModelInfo

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.plan.resolved import ResolvedPlan

DECODE_ROWS = 8  # sequences in a decode step (the rows of each linear layer's input)
DECODE_CONTEXT = 512  # cached tokens per sequence the attention reads
BLOCK_SIZE = 64  # cache.block_size of the attention timing (the plans' default)
COLD_BYTES = 64 * 2**20  # per shape: twice the last-level cache of the CPUs this runs on
ELEMENT_BYTES = 4  # fp32, the dtype the `cpu` figures are measured in
HOST_CONTEXT = 16  # cached tokens per sequence of the host timing: too few for the attention to count
HOST_REPEATS = 30
TIMING_REPEATS = 5  # passes of each linear shape / of the attention; the median is the figure
SERVED_TOKENS = 32  # tokens each request of the served timing decodes
LONE_REPEATS = 3  # passes a shape in each round of a lone rank's timing (a round after each two-rank run)
TWO_RANK_RUNS = 3  # runs of the two-rank step (a run's ranks tend to stay in one wait regime); the median counts
TINY_MAX_EXPERTS = 64
TINY_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v2",
}


@dataclass(frozen=True)
class LinearShape:
    """One kind of linear layer: an [out, in] weight used `count` times per decode step."""

    out_features: int
    in_features: int
    count: int

    @property
    def elements(self) -> int:
        return self.out_features * self.in_features


@dataclass(frozen=True)
class DecodeShapes:
    """The shapes a decode step of a model runs at (one rank holding the whole model)."""

    linears: tuple[LinearShape, ...]
    heads: int  # query heads attending
    kv_heads: int
    key_dim: int
    value_dim: int
    value_in_key: bool  # MLA: values are the first value_dim dims of the (latent) keys
    tiny_arch: str  # the host timing's checkpoint (engine.checkpoints.tiny): architecture and sizes
    tiny_sizes: dict

    @property
    def key(self) -> str:
        """What the cached figures of these shapes are filed under."""
        linears = ",".join(f"{s.out_features}x{s.in_features}x{s.count}" for s in self.linears)
        attention = f"{self.heads}/{self.kv_heads}x{self.key_dim}/{self.value_dim}{'m' if self.value_in_key else ''}"
        tiny = ",".join(f"{k}={v}" for k, v in sorted(self.tiny_sizes.items()))
        return f"{linears};{attention};{self.tiny_arch}:{tiny}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DecodeShapes:
        return cls(**{**data, "linears": tuple(LinearShape(**s) for s in data["linears"])})


def decode_shapes(model: ModelInfo) -> DecodeShapes:
    """The linear layers and attention of one decode step of `model` on one rank (tp 1, dcp 1)."""
    hidden, layers, heads = model.hidden_size, model.num_layers, model.num_heads
    if model.is_mla:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        latent = model.kv_lora_rank + model.qk_rope_head_dim
        if model.q_lora_rank:
            q = [LinearShape(model.q_lora_rank, hidden, layers), LinearShape(heads * qk, model.q_lora_rank, layers)]
        else:
            q = [LinearShape(heads * qk, hidden, layers)]
        kv_b = heads * (model.qk_nope_head_dim + model.v_head_dim)
        attention = [*q, LinearShape(latent, hidden, layers), LinearShape(kv_b, model.kv_lora_rank, layers)]
        attention.append(LinearShape(hidden, heads * model.v_head_dim, layers))
        kv_heads, key_dim, value_dim = 1, latent, model.kv_lora_rank
    else:
        d = model.head_dim
        attention = [LinearShape((heads + 2 * model.num_kv_heads) * d, hidden, layers)]
        attention.append(LinearShape(hidden, heads * d, layers))
        kv_heads, key_dim, value_dim = model.num_kv_heads, d, d
    moe_layers = layers - model.first_k_dense_replace if model.n_routed_experts else 0
    mlp = []
    if layers - moe_layers:
        mlp += [LinearShape(2 * model.intermediate_size, hidden, layers - moe_layers)]
        mlp += [LinearShape(hidden, model.intermediate_size, layers - moe_layers)]
    if moe_layers:  # the experts each token runs (routed and shared), as one expert's projections
        experts = moe_layers * (model.experts_per_token + model.n_shared_experts)
        mlp += [LinearShape(2 * model.moe_intermediate_size, hidden, experts)]
        mlp += [LinearShape(hidden, model.moe_intermediate_size, experts)]
    lm_head = LinearShape(model.vocab_size, hidden, 1)
    arch, sizes = tiny_like(model)
    return DecodeShapes((*attention, *mlp, lm_head), heads, kv_heads, key_dim, value_dim, model.is_mla, arch, sizes)


def tiny_like(model: ModelInfo) -> tuple[str, dict]:
    """A tiny checkpoint's architecture and sizes with the model's depth, heads and kind of layers (MLA, MoE) and
    widths that make its matmuls and attention negligible: what the host timing runs."""
    # transformers wants the hidden size a multiple of the heads
    sizes = {"num_layers": model.num_layers, "num_heads": model.num_heads, "tie_word_embeddings": False}
    arch = TINY_ARCHS[model.architecture]
    if arch == "deepseek_v2":
        sizes["hidden_size"] = model.num_heads
        # a step runs at most rows x experts_per_token routed experts: more experts add weights, not host work
        experts = min(model.n_routed_experts, TINY_MAX_EXPERTS)
        sizes.update(n_routed_experts=experts, n_shared_experts=model.n_shared_experts)
        sizes.update(
            num_experts_per_tok=model.experts_per_token or 1, first_k_dense_replace=model.first_k_dense_replace
        )
        sizes.update(q_lora_rank=8 if model.q_lora_rank else None, moe_intermediate_size=8)
    else:
        sizes.update(hidden_size=8 * model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=8)
    return arch, sizes


def _passes(run, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `run`, after one untimed call (first touch and warm-up)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def _median_pass(run, repeats: int) -> float:
    return statistics.median(_passes(run, repeats))


def _no_sync() -> None:
    pass


def linear_flops(
    shapes: DecodeShapes, rows: int = DECODE_ROWS, repeats: int = TIMING_REPEATS, sync: Callable[[], None] = _no_sync
) -> float:
    """fp32 FLOP/s of torch's threads (`torch.get_num_threads`) running the engine's linear layers at `rows` rows
    over the model's shapes, each shape weighted by how many times a step runs it (each shape's median pass).
    `sync` is called before each shape's timing (processes timed side by side start each shape together)."""
    import torch

    from engine.layers.linear import ReplicatedLinear

    seconds = flops = 0.0
    for shape in shapes.linears:
        # a very large weight (an LM head of 100k+ rows) is timed on a slice of its rows: its rate, not its size
        out = max(1, min(shape.out_features, COLD_BYTES // (ELEMENT_BYTES * shape.in_features)))
        copies = max(1, COLD_BYTES // (ELEMENT_BYTES * out * shape.in_features))
        layers = []
        for _ in range(copies):
            layer = ReplicatedLinear(shape.in_features, out)
            layer.weight.data.uniform_(-0.05, 0.05)
            layer.pack()
            layers.append(layer)
        x = torch.randn(rows, shape.in_features)

        def run(x=x, layers=layers) -> None:
            for layer in layers:
                layer(x)

        sync()
        per_element = _median_pass(run, repeats) / (copies * out * shape.in_features)
        seconds += per_element * shape.elements * shape.count
        flops += 2.0 * rows * shape.elements * shape.count
    return flops / seconds


def attention_bytes(
    shapes: DecodeShapes,
    rows: int = DECODE_ROWS,
    context: int = DECODE_CONTEXT,
    repeats: int = TIMING_REPEATS,
    sync: Callable[[], None] = _no_sync,
) -> float:
    """KV bytes per second torch's threads' paged decode attention (the engine's CPU backend) reads, at `rows`
    sequences of `context` tokens of the model's heads (the median pass; `sync` as for `linear_flops`)."""
    import torch

    from engine.attention import kv_cache
    from engine.attention.backend import PagedKV
    from engine.attention.cpu_backend import CpuBackend

    backend = CpuBackend()
    kinds = 1 if shapes.value_in_key else 2
    layer_bytes = rows * context * shapes.kv_heads * shapes.key_dim * kinds * ELEMENT_BYTES
    layers = max(2, COLD_BYTES // layer_bytes)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    storage, views = kv_cache.allocate(
        layers,
        rows * blocks_per_seq,
        BLOCK_SIZE,
        shapes.kv_heads,
        shapes.key_dim,
        shapes.value_in_key,
        torch.float32,
        torch.device("cpu"),
        head_major=getattr(backend, "head_major_cache", False),
    )
    storage.uniform_(-1.0, 1.0)  # real pages: an untouched cache reads the kernel's shared zero page
    tables = torch.arange(rows * blocks_per_seq, dtype=torch.int64).view(rows, blocks_per_seq)
    kv = PagedKV(
        block_tables=tables,
        lens=torch.full((rows,), context, dtype=torch.int64),
        query_start=torch.arange(rows + 1, dtype=torch.int64),
        query_counts=[1] * rows,
        local_lens=[context] * rows,
        max_len=context,
        block_size=BLOCK_SIZE,
    )
    q = torch.randn(rows, shapes.heads, shapes.key_dim)
    scale = shapes.key_dim**-0.5

    def run() -> None:
        for keys, values in views:
            backend.paged(q, keys, values, shapes.value_dim, kv, scale)

    sync()
    return layers * layer_bytes / _median_pass(run, repeats)


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
    return statistics.median(_passes(engine.step, HOST_REPEATS))


def host_seconds_per_layer(folder: Path, dcp: int, layers: int, rows: int = DECODE_ROWS) -> float:
    """Median seconds per layer of the engine's decode step (`LLMEngine.step`: schedule, run, sample, detokenize)
    of `rows` greedy sequences on rank 0 of a tp 1 / `dcp` plan of the (tiny) checkpoint in `folder`, run in this
    process alone, with the threads the engine gives each of the plan's ranks on this node."""
    import torch
    from transformers import AutoConfig

    from engine import devices
    from engine.attention.registry import create_backend
    from engine.core.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.distributed import init_single
    from engine.runtime.model_runner import CacheLayout, ModelRunner

    res = _host_plan(folder, dcp)
    config = EngineConfig.from_plan(res)
    torch.set_num_threads(max(1, devices.cpu_cores() // config.local_world_size))
    par = init_single(config.placement, torch.device("cpu"))
    hf_config = AutoConfig.from_pretrained(folder)
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


def _per_core_worker(rank: int, procs: int, store_dir: str, shapes: dict, cold_bytes: int, out: str) -> None:
    """One of `procs` one-thread processes timing the linears and the attention side by side with the others (each
    shape's timing started together), as the ranks of a layout with a rank per core run them; writes its figures to
    `out`.`rank`. `cold_bytes`: the parent's `COLD_BYTES` (a spawned process imports the module afresh)."""
    import torch
    import torch.distributed as dist

    from engine.runtime.host_allocator import reuse_freed_memory

    global COLD_BYTES
    COLD_BYTES = cold_bytes
    reuse_freed_memory()  # as every CPU rank of the engine does
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", procs), rank=rank, world_size=procs)
    timed = DecodeShapes.from_dict(shapes)
    figures = {
        "linear_flops_per_core": linear_flops(timed, sync=dist.barrier),
        "attention_bytes_per_core": attention_bytes(timed, sync=dist.barrier),
    }
    dist.barrier()
    Path(f"{out}.{rank}").write_text(json.dumps(figures))
    dist.destroy_process_group()


def per_core_figures(shapes: DecodeShapes, procs: int) -> dict[str, float]:
    """{linear_flops_per_core, attention_bytes_per_core}: `linear_flops` and `attention_bytes` on one thread while
    `procs` processes (a rank per core of this node) run the same work at once, sharing the memory system and the
    caches as a layout's ranks do; the median over the processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/figures"
        mp.start_processes(
            _per_core_worker, args=(procs, tmp, shapes.to_dict(), COLD_BYTES, out), nprocs=procs, start_method="spawn"
        )
        each = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(procs)]
    return {key: statistics.median(figures[key] for figures in each) for key in each[0]}


def decode_figures(shapes: DecodeShapes) -> dict[str, float]:
    """The engine's decode work at `shapes` on this CPU: {linear_flops_per_core, attention_bytes_per_core} on one
    thread of each core at once (`per_core_figures`: a layout's ranks, a rank per core),
    {linear_flops_one_rank, attention_bytes_one_rank} with one rank's threads on every core (its parallel regions
    wait for each other; the median of rounds spread over the whole timing, a lone rank's two threads being the
    most sensitive to anything else running), {layer_host_s, dcp_layer_host_s} (`host_seconds_per_layer` of a
    one-rank and of a dcp 2 layout), serve_token_s: what serving the one-rank step (`served_step_seconds`) adds to
    it, per streamed token, and step_collective_s: what running the dcp 2 step as two ranks
    (`two_rank_step_seconds`, the median of `TWO_RANK_RUNS` runs) adds to rank 0's step run alone, per collective
    the suggestion charges that layout (never below 0)."""
    import torch

    from engine import devices
    from engine.checkpoints.tiny import make_tiny_checkpoint
    from engine.runtime.host_allocator import reuse_freed_memory

    reuse_freed_memory()  # as every CPU rank of the engine does
    threads = torch.get_num_threads()
    cores = devices.cpu_cores()
    figures = per_core_figures(shapes, cores)
    lone: list[tuple[float, float]] = []  # a lone rank's (FLOP/s, KV bytes/s), in rounds spread over the timing

    def lone_round() -> None:
        torch.set_num_threads(cores)
        lone.append((linear_flops(shapes, repeats=LONE_REPEATS), attention_bytes(shapes, repeats=LONE_REPEATS)))

    try:
        lone_round()
        layers = shapes.tiny_sizes["num_layers"]
        with tempfile.TemporaryDirectory() as tmp:
            folder = make_tiny_checkpoint(Path(tmp) / "tiny", shapes.tiny_arch, **shapes.tiny_sizes)
            figures["layer_host_s"] = host_seconds_per_layer(folder, 1, layers)
            served_s = served_step_seconds(folder)
            figures["serve_token_s"] = max(0.0, served_s - figures["layer_host_s"] * layers) / DECODE_ROWS
            figures["dcp_layer_host_s"] = host_seconds_per_layer(folder, 2, layers)
            two_rank = []
            for _ in range(TWO_RANK_RUNS):
                two_rank.append(two_rank_step_seconds(folder))
                lone_round()
            added_s = max(0.0, statistics.median(two_rank) - figures["dcp_layer_host_s"] * layers)
            figures["step_collective_s"] = added_s / step_collectives(folder, 2)
        figures["linear_flops_one_rank"] = statistics.median(flops for flops, _ in lone)
        figures["attention_bytes_one_rank"] = statistics.median(kv for _, kv in lone)
        return figures
    finally:
        torch.set_num_threads(threads)
