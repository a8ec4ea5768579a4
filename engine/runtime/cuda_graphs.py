"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket (vLLM's cudagraph capture sizes).

A decode-only step of n sequences runs the graph of the smallest bucket b >= n: its inputs (token ids, positions,
slot mapping, DCP-local lengths, block tables) are copied into static buffers, rows n..b-1 padded so that they
change nothing (slot -1: no cache write; local length 0: no keys, output 0), and the whole forward pass and LM head
replay with one launch. A graph's attention reads the lengths from the buffers, so the kernels' split count is fixed
at capture by the longest local length a sequence can have (max_model_len's shard). The DCP combine's collectives are
captured with the rest (NCCL allows it; gloo does not, so graphs are CUDA-only). Prefill and mixed steps, steps that
need more than one logit row per sequence (prompt logprobs, speculative verification) and batches above the largest
bucket run eagerly.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata, PagedKV, step_metadata

GRAPH_BACKENDS = ("triton", "flash_attn")
"""Backends whose decode path reads its lengths from device tensors only (no host values per step)."""

# padding of the rows past a step's sequences: token 0 at position 0, no cache slot, no cached keys
_PAD = (0, 0, -1, 0)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to and including max_num_seqs."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return sorted(sizes)


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `rows` sequences, or None (more than the largest: run eagerly)."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeRows:
    """One decode-only step as host values, one entry per sequence (the same on every rank but the slots/lengths)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # -1: another DCP rank stores the token
    local_lens: list[int]  # this rank's cached tokens of the sequence, the new one included
    tables: list[list[int]]


class StaticDecodeInputs:
    """Device buffers a captured decode step reads, sized for the largest bucket; `fill` writes a step into them."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device):
        self.vectors = torch.zeros(4, max_rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slots, self.lens = self.vectors.unbind(0)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.int64, device=device)
        self.query_start = torch.arange(max_rows + 1, dtype=torch.int64, device=device)

    def fill(self, rows: DecodeRows, bucket: int) -> None:
        """Copy the step's n rows into the first `bucket` rows, the rest padded (two host-to-device copies)."""
        n = len(rows.input_ids)
        pad = bucket - n
        vectors = [rows.input_ids, rows.positions, rows.slots, rows.local_lens]
        host = torch.tensor([v + [p] * pad for v, p in zip(vectors, _PAD, strict=True)], dtype=torch.int64)
        self.vectors[:, :bucket].copy_(host, non_blocking=True)
        width = max((len(t) for t in rows.tables), default=1)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in rows.tables] + [[0] * width] * pad)
        self.tables[:bucket, :width].copy_(tables, non_blocking=True)

    def metadata(self, bucket: int, backend, max_len: int, block_size: int, need_lse: bool) -> AttentionMetadata:
        """Attention metadata of a `bucket`-row decode step whose tensors are views of the buffers."""
        decode = PagedKV(
            block_tables=self.tables[:bucket],
            lens=self.lens[:bucket],
            query_start=self.query_start[: bucket + 1],
            query_counts=[1] * bucket,
            local_lens=[max_len] * bucket,  # host bound only: the kernels read `lens`
            max_len=max_len,
            block_size=block_size,
            need_lse=need_lse,
        )
        return AttentionMetadata(
            backend=backend,
            slot_mapping=self.slots[:bucket],
            num_prefill_tokens=0,
            num_decode_tokens=bucket,
            decode=decode,
        )


StepForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
"""(input_ids, positions) -> the step's logits, on the rank that gets them (None elsewhere)."""


class DecodeGraphs:
    """The captured decode graphs of one rank, sharing one memory pool, and the buffers they read."""

    def __init__(
        self,
        forward: StepForward,
        backend,
        sizes: list[int],
        max_len: int,
        max_blocks: int,
        block_size: int,
        need_lse: bool,
        device: torch.device,
    ):
        self.sizes = sizes
        self.inputs = StaticDecodeInputs(sizes[-1], max_blocks, device)
        self._forward, self._backend = forward, backend
        self._max_len, self._block_size, self._need_lse = max_len, block_size, need_lse
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.capture_seconds = 0.0

    def step(self, bucket: int) -> torch.Tensor | None:
        """The decode step on the buffers' first `bucket` rows, run eagerly (what `capture` records)."""
        md = self.inputs.metadata(bucket, self._backend, self._max_len, self._block_size, self._need_lse)
        self._backend.prepare(md)  # inside the graph: a backend's per-step tensors are recomputed on replay
        with step_metadata(md):
            return self._forward(self.inputs.input_ids[:bucket], self.inputs.positions[:bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, the largest first (later ones reuse its pool), on padding-only inputs."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            self.inputs.fill(DecodeRows([], [], [], [], []), bucket)
            for _ in range(2):  # compile the Triton kernels and settle the allocator outside the graph
                self.step(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.step(bucket)
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def run(self, rows: DecodeRows) -> torch.Tensor | None:
        """Replay the step's bucket (it has at most the largest bucket's rows) and return the logits of its n rows,
        valid until the next replay (None on a rank that gets no logits)."""
        bucket = bucket_for(len(rows.input_ids), self.sizes)
        self.inputs.fill(rows, bucket)
        graph, out = self._graphs[bucket]
        graph.replay()
        return None if out is None else out[: len(rows.input_ids)]
