"""Every rank's start: join the plan's layout, build the model runner and its KV cache; then rank 0 drives and
the other ranks follow.

`start_engine` is the one start-up path (the Python API and the server both take it): every rank runs `start_rank`;
rank 0 wraps its runner in an `LLMEngine`, and the other ranks run `follow` until rank 0 stops them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from engine import devices
from engine.attention.registry import create_backend
from engine.checkpoints.config_values import ConfigValues, read_config
from engine.checkpoints.model_info import dtype_bytes
from engine.checkpoints.weights import checkpoint_files
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.distributed import ParallelContext, broadcast_object, gather_objects, init_parallel, init_single
from engine.errors import UserError
from engine.gc_pause import gc_paused
from engine.io_utils import atomic_write_text
from engine.kernels.cpu_kernels import cpu_kernels_available
from engine.kernels.cpu_threads import rank_cores
from engine.kv_transfer.handles import KVRole
from engine.plan.kv_sizing import kv_sizing
from engine.plan.resolved import ResolvedPlan
from engine.runtime.host_allocator import reuse_freed_memory
from engine.runtime.model_runner import TORCH_DTYPES, CacheLayout, ModelRunner


def _set_threads(config: EngineConfig) -> None:
    if config.device != "cpu":
        return
    torch.set_num_threads(config.threads_per_rank or max(1, devices.cpu_cores() // config.local_world_size))


def _thread_cores(config: EngineConfig, par: ParallelContext) -> tuple[int, ...] | None:
    """The cores this rank's OpenMP threads are pinned to (`cpu_threads.rank_cores`); None on GPU or without the
    engine's kernels (the pinning is one of their ops)."""
    if config.device != "cpu" or not cpu_kernels_available():
        return None
    return rank_cores(devices.cpu_set(), par.local_rank, config.local_world_size, torch.get_num_threads())


def _num_blocks(config: EngineConfig, par: ParallelContext) -> int:
    """KV blocks per rank: the plan's count, else what the GPU's free memory buys (the least over all ranks; rank 0
    also holds a draft model's cache)."""
    if config.num_blocks is not None:
        return config.num_blocks
    free, _ = torch.cuda.mem_get_info(par.device)
    budget = int(free * config.kv_memory_fraction)
    spec = config.speculative
    draft = spec.draft.info if spec is not None and spec.draft is not None and par.is_driver else None
    sizing = kv_sizing(
        config.model, par.tp_size, par.dcp_size, config.block_size, dtype_bytes(config.cache_dtype), budget, draft
    )
    blocks = torch.tensor([sizing.num_blocks], device=par.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN)
    return int(blocks.item())


def start_rank(
    resolved: ResolvedPlan, kv_role: KVRole | None = None
) -> tuple[EngineConfig, ParallelContext, ModelRunner]:
    """Join the plan's layout (torchrun world, or a single process) and build this rank's runner (with its part in
    a P/D hand-off when `kv_role` says so)."""
    config = EngineConfig.from_plan(resolved, kv_role)
    read = _read_config_on_rank_0(config.model_path)  # while the other ranks still import and join
    layout = config.layout
    device = torch.device("cuda" if config.device == "cuda" else "cpu")
    if layout.world_size == 1 and "RANK" not in os.environ:
        par = init_single(config.placement, device)
    else:
        par = init_parallel(
            config.placement, config.device, config.dist_backend, config.cpu_comm, config.cpu_comm_strict
        )
    _set_threads(config)
    if device.type == "cpu":
        reuse_freed_memory()
    checkpoint_files(config.model_path)  # a clear error for a folder without weights, before any work
    hf_config = _shared_config(read, par)
    runner = ModelRunner(
        hf_config,
        config.model_path,
        par,
        TORCH_DTYPES[config.dtype],
        create_backend(config.attention_backend),
        config.max_model_len,
    )
    runner.allocate_cache(
        CacheLayout(
            num_blocks=_num_blocks(config, par),
            block_size=config.block_size,
            interleave=config.interleave,
            dtype=TORCH_DTYPES[config.cache_dtype],
            calculate_scales=config.calculate_kv_scales,
        )
    )
    if kv_role is not None:
        runner.attach_kv_role(kv_role)
    if device.type == "cuda":
        graphs = "CUDA graphs: off (model.enforce_eager)"
        if not config.enforce_eager:
            graphs = runner.capture_graphs(config.scheduler.max_num_seqs, config.max_model_len)
        if par.is_driver:
            print(f"dcpctl: {graphs}", file=sys.stderr, flush=True)
    runner.thread_cores = _thread_cores(config, par)
    _write_rank_stats(par, runner)
    if runner.cpu_paths and par.is_driver:
        print(f"dcpctl: {runner.cpu_paths}", file=sys.stderr, flush=True)
    if par.collectives and par.is_driver:
        print(f"dcpctl: collectives: {par.collectives}", file=sys.stderr, flush=True)
    return config, par, runner


def _read_config_on_rank_0(folder: str) -> ConfigValues | str | None:
    """The checkpoint's config read with transformers on rank 0 (the message of a config it cannot read), None on
    the other ranks: they start without importing transformers and receive it (`_shared_config`)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        with gc_paused():
            return read_config(folder)
    except UserError as exc:
        return str(exc)


def _shared_config(read: ConfigValues | str | None, par: ParallelContext) -> ConfigValues:
    """Rank 0's config on every rank; a config rank 0 could not read fails every rank with the same message."""
    read = broadcast_object(read, par.control_group)
    if isinstance(read, str):
        raise UserError(read)
    return read


def _write_rank_stats(par: ParallelContext, runner: ModelRunner) -> None:
    """With DCPCTL_RANK_STATS_DIR set, each rank records its KV cache and weight allocations and what carries its
    collectives (for tests and tooling)."""
    folder = os.environ.get("DCPCTL_RANK_STATS_DIR")
    if not folder:
        return
    stats = {
        "rank": par.rank,
        "world_size": par.world_size,
        "tp_rank": par.tp_rank,
        "dcp_rank": par.dcp_rank,
        "kv_cache_bytes": runner.kv_cache_bytes,
        "weight_bytes": runner.weight_bytes,
        "kv_cache_shape": list(runner.kv_cache.shape),
        "num_blocks": runner.cache_layout.num_blocks,
        "collectives": par.collectives,
    }
    atomic_write_text(Path(folder) / f"rank{par.rank}.json", json.dumps(stats))


def start_engine(
    resolved: ResolvedPlan, shield_followers: bool = False, kv_role: KVRole | None = None
) -> LLMEngine | None:
    """Every rank's start: rank 0 gets its engine; any other rank follows rank 0's steps until rank 0 stops it,
    then gets None.

    `kv_role`: the instance's part in a P/D deployment (a prefill instance's rank 0 learns every rank's NIXL
    endpoint). `shield_followers`: the followers ignore SIGINT and SIGTERM (a server's ranks). Rank 0 decides when
    to stop (it tells them after its last step); a signal from torchrun must not kill a follower in the middle of a
    collective, which would leave rank 0 hanging.
    """
    config, par, runner = start_rank(resolved, kv_role)
    exporter = runner.kv_exporter
    endpoints = gather_objects(exporter.endpoint, par.control_group) if exporter is not None else None
    if shield_followers:
        if not par.is_driver:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        # rank 0 serves (and can be told to stop) only once every follower is shielded
        gather_objects(None, par.control_group)
    if par.is_driver:
        return LLMEngine(config, par, runner, endpoints)
    follow(par, runner)
    return None


def follow(par: ParallelContext, runner: ModelRunner) -> None:
    """Non-driver ranks: run every step rank 0 sends until it sends None."""
    while True:
        step = broadcast_object(None, par.control_group)
        if step is None:
            return
        runner.receive(step)
        runner.execute(step)
