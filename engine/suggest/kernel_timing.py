"""The engine's linear layers and paged decode attention timed on this CPU at a model's decode shapes: on torch's
threads (one rank over all cores) or on one thread per core with every core doing the same at once
(`per_core_figures`: a layout with a rank per core). Each figure is the median of repeated passes over copies of
the weights (the caches) filling `COLD_BYTES`, so that a pass reads them from memory as a step of a large model
does."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from engine.suggest.decode_shapes import DecodeShapes

DECODE_ROWS = 8  # sequences in a decode step (the rows of each linear layer's input)
DECODE_CONTEXT = 512  # cached tokens per sequence the attention reads
BLOCK_SIZE = 64  # cache.block_size of the attention timing (the plans' default)
COLD_BYTES = 64 * 2**20  # per shape: twice the last-level cache of the CPUs this runs on
ELEMENT_BYTES = 4  # fp32, the dtype the `cpu` figures are measured in
TIMING_REPEATS = 5  # passes of each linear shape / of the attention; the median is the figure


def timed_passes(run, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `run`, after one untimed call (first touch and warm-up)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def median_pass(run, repeats: int) -> float:
    """The median of `timed_passes`."""
    return statistics.median(timed_passes(run, repeats))


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
        per_element = median_pass(run, repeats) / (copies * out * shape.in_features)
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
    return layers * layer_bytes / median_pass(run, repeats)


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
