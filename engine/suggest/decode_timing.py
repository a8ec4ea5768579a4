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

The shapes come from `decode_shapes`, the linears' and attention's timings from `kernel_timing`, the host work's
from `host_timing`; this module runs them in the order that keeps a lone rank's rounds spread over the timing.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from engine.suggest.decode_shapes import DecodeShapes
from engine.suggest.host_timing import (
    host_seconds_per_layer,
    served_step_seconds,
    step_collectives,
    two_rank_step_seconds,
)
from engine.suggest.kernel_timing import DECODE_ROWS, attention_bytes, linear_flops, per_core_figures

LONE_REPEATS = 3  # passes a shape in each round of a lone rank's timing (a round after each two-rank run)
TWO_RANK_RUNS = 3  # runs of the two-rank step (a run's ranks tend to stay in one wait regime); the median counts


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
