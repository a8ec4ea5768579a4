"""Runs the model on one rank: builds it, loads its slices, owns its KV cache, executes scheduled steps.

Every rank runs the same step; per step the runner turns it into tensors and attention metadata
once (slot mapping and local lengths from the DCP math), then the layers read that metadata.
The runner decides no policy: what to run comes from rank 0's scheduler.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import dcp, kv_quant
from engine.attention import kv_cache
from engine.attention.backend import AttentionBackend, AttentionMetadata, PagedKV, PrefillNew, step_metadata
from engine.checkpoints.kv_scales import read_kv_scales
from engine.distributed import ParallelContext, gather_objects
from engine.errors import UserError
from engine.kernels.cpu_gemm import cpu_paths_line, pack_linears
from engine.kernels.cpu_kernels import bind_threads, cpu_kernels_available, release_openmp_pool
from engine.kv_transfer.handles import KVRole, PullReport
from engine.kv_transfer.ranks import KVExporter, KVReceiver
from engine.layers.attention import PagedAttention
from engine.models import build_model
from engine.models.base import streamline_modules
from engine.models.loading import load_checkpoint
from engine.runtime.cuda_graphs import GRAPH_BACKENDS, DecodeGraphs, DecodeRows, capture_sizes
from engine.runtime.step import ScheduledChunk, ScheduledStep

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, **kv_quant.FP8_DTYPES}


@dataclass(frozen=True)
class CacheLayout:
    """The KV cache slice of a plan that the runner needs."""

    num_blocks: int
    block_size: int
    interleave: int
    dtype: torch.dtype
    calculate_scales: bool = False  # an fp8 cache: scales from the first prefill (cache.calculate_kv_scales)


def calibration_line(scales: list[tuple[float, float]], tokens: int) -> str:
    """What a calibration set: the range of the layers' K and V scales."""
    ks, vs = [k for k, _ in scales], [v for _, v in scales]
    return (
        f"fp8 KV scales calibrated from the first prefill ({tokens} tokens): k_scale {min(ks):.4g}..{max(ks):.4g}, "
        f"v_scale {min(vs):.4g}..{max(vs):.4g} over {len(scales)} layers"
    )


class _ThreadCpus:
    """Each pinned thread's CPU set from before the first runner pinned it, and how many runners hold it pinned: two
    engines stepped from one thread (two `LLM`s in a script) must not take the other's pinning for the thread's own
    set, whichever closes first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[set[int], int]] = {}

    def hold(self, native_id: int) -> None:
        with self._lock:
            cpus, holders = self._held.get(native_id, (None, 0))
            self._held[native_id] = (os.sched_getaffinity(0) if cpus is None else cpus, holders + 1)

    def release(self, native_id: int) -> None:
        with self._lock:
            cpus, holders = self._held.pop(native_id)
            if holders > 1:
                self._held[native_id] = (cpus, holders - 1)
                return
            with suppress(OSError):  # the thread has ended
                os.sched_setaffinity(native_id, cpus)


_THREAD_CPUS = _ThreadCpus()


@dataclass
class StepLogits:
    """fp32 logits for the rows a step asked for, and which rows belong to which chunk."""

    logits: torch.Tensor  # [R, V]
    chunk_rows: list[tuple[int, int]]  # per chunk: (first row, row count); count 0 = no logits


class ModelRunner:
    def __init__(
        self,
        hf_config,
        folder: Path,
        par: ParallelContext,
        dtype: torch.dtype,
        backend: AttentionBackend,
        max_model_len: int,
    ):
        self.par = par
        self.device = par.device
        self.backend = backend
        self.hf_config = hf_config
        self.vocab_size = hf_config.vocab_size
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(hf_config, max_model_len, self.device)
        finally:
            torch.set_default_dtype(previous)
        load_checkpoint(self.model, folder, self.model.checkpoint_name_map)
        self.folder = folder
        self.gemms = pack_linears(self.model)
        self.dtype = dtype
        self.cpu_paths: str | None = None  # the start-up line of a CPU rank, once its cache is allocated
        streamline_modules(self.model)
        self.model.eval()
        self.cache_layout: CacheLayout | None = None
        self.kv_cache: torch.Tensor | None = None
        self.kv_exporter: KVExporter | None = None
        self.kv_receiver: KVReceiver | None = None
        self.thread_cores: tuple[int, ...] | None = None  # where the stepping thread's OpenMP team is pinned
        self._pinned: int | None = None  # the native id of the stepping thread this runner pinned
        self.graphs: DecodeGraphs | None = None
        self._report_calibration = False  # the first step with a prefill calibrates the scales: say what they are

    def allocate_cache(self, layout: CacheLayout) -> None:
        """One allocation for all layers, in the backend's preferred layout; each attention layer gets views of it."""
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        first = layers[0]
        self.cache_layout = layout
        if self.device.type == "cpu":
            self.cpu_paths = cpu_paths_line(self.dtype, self.gemms, self.backend, layout.dtype)
        self.kv_cache, views = kv_cache.allocate(
            len(layers),
            layout.num_blocks,
            layout.block_size,
            first.num_kv_heads,
            first.key_dim,
            first.value_in_key,
            layout.dtype,
            self.device,
            head_major=getattr(self.backend, "head_major_cache", False),
        )
        for layer, (keys, values) in zip(layers, views, strict=True):
            layer.key_cache, layer.value_cache = keys, values
        if kv_quant.is_fp8(layout.dtype):
            self._set_kv_scales(layers, layout.calculate_scales)

    def _set_kv_scales(self, layers: list[PagedAttention], calculate: bool) -> None:
        """An fp8 cache's scales, as vLLM sets them: calibrated from the first prefill when asked, else the
        checkpoint's k_scale / v_scale, else 1.0."""
        if calculate:
            for layer in layers:
                layer.calibrating = True
            self._report_calibration = True
            return
        for index, (k, v) in read_kv_scales(self.folder, layers[0].value_in_key).items():
            if index >= len(layers):
                raise UserError(
                    f"{self.folder}: the checkpoint has KV cache scales for layer {index}, but the model has "
                    f"{len(layers)} layers; is config.json from the same checkpoint?"
                )
            layer = layers[index]
            layer.k_scale = layer.k_scale if k is None else kv_quant.fp32(k)
            layer.v_scale = layer.v_scale if v is None else kv_quant.fp32(v)

    @property
    def kv_scales(self) -> list[tuple[float, float]]:
        """(k_scale, v_scale) of every layer's cache, in layer order."""
        return [m.scales for m in self.model.modules() if isinstance(m, PagedAttention)]

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> str:
        """Capture decode steps of 1..max_num_seqs sequences as CUDA graphs (after `allocate_cache`); returns the
        start-up line that says what was captured, or why decode runs eagerly."""
        if self.device.type != "cuda":
            return "CUDA graphs: off (CPU)"
        if self.cache_layout.calculate_scales:
            return "CUDA graphs: off (cache.calculate_kv_scales: the first prefill sets the scales graphs would read)"
        if self.backend.name not in GRAPH_BACKENDS:
            return f"CUDA graphs: off (attention.backend {self.backend.name}; graphs need {', '.join(GRAPH_BACKENDS)})"
        c = self.cache_layout
        d = self.par.dcp_size
        graphs = DecodeGraphs(
            self._graph_forward,
            self.backend,
            capture_sizes(max_num_seqs),
            max_len=dcp.local_len(max_model_len, 0, c.interleave, d),  # rank 0 holds the most of any length
            max_blocks=-(-max_model_len // (c.block_size * d)),
            block_size=c.block_size,
            need_lse=d > 1,
            device=self.device,
        )
        graphs.capture()
        self.graphs = graphs
        sizes, seconds = graphs.sizes, graphs.capture_seconds
        return f"CUDA graphs: {len(sizes)} decode batch sizes ({sizes[0]}..{sizes[-1]}) captured in {seconds:.1f} s"

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The eager step's work for a graph: the forward pass, and the logits where `execute` computes them."""
        hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden) if self.par.computes_logits else None

    def _replayable(self, step: ScheduledStep) -> bool:
        """A decode-only step with one logit row per sequence, within the largest captured batch size."""
        return (
            self.graphs is not None
            and step.num_prefills == 0
            and len(step.chunks) <= self.graphs.sizes[-1]
            and all(ch.num_logit_rows == 1 for ch in step.chunks)
        )

    def attach_kv_role(self, role: KVRole) -> None:
        """A P/D instance's rank: export the KV storage (prefill) or get ready to pull into it (decode)."""
        head_major = getattr(self.backend, "head_major_cache", False)
        kv_cache.fault_in(self.kv_cache)  # transfers then never pay page faults
        geometry = kv_cache.geometry(self.kv_cache, head_major)
        on_gpu = self.device.type == "cuda"
        if role.role == "prefill":
            self.kv_exporter = KVExporter(self.par.rank, geometry, on_gpu)
        else:
            c = self.cache_layout
            spec = dcp.DcpSpec(c.block_size, c.interleave, self.par.dcp_size)
            self.kv_receiver = KVReceiver(self.par.rank, self.par.dcp_rank, self.par.layout, spec, geometry, on_gpu)

    def receive(self, step: ScheduledStep) -> list[PullReport] | None:
        """Carry out the step's pulls on this rank (before `execute`); rank 0 gets every rank's reports."""
        if not step.pulls:
            return None
        reports = self.kv_receiver.pull(step.pulls)
        gathered = gather_objects(reports, self.par.control_group)
        return None if gathered is None else [r for rank_reports in gathered for r in rank_reports]

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters on this rank (a tied LM head counted once; packed copies not counted)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _metadata(
        self, step: ScheduledStep, cu: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor
    ) -> AttentionMetadata:
        d = self.par.dcp_size
        num_prefills = step.num_prefills
        prefill_counts = [len(ch.token_ids) for ch in step.chunks[:num_prefills]]
        prefill_tokens = sum(prefill_counts)
        md = AttentionMetadata(
            backend=self.backend,
            slot_mapping=slots,
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=len(step.chunks) - num_prefills,
        )
        if num_prefills:
            md.prefill = PrefillNew(
                cu_seqlens=cu[: num_prefills + 1], seq_lens=prefill_counts, max_len=max(prefill_counts)
            )
            context = [ch.start for ch in step.chunks[:num_prefills]]
            with_context = [i for i, n in enumerate(context) if n]
            if with_context:  # only the chunks from the first to the last with context attend to the cache
                lo, hi = with_context[0], with_context[-1] + 1
                md.prefill_context = self._paged_kv(
                    tables[lo:hi], context[lo:hi], cu[lo : hi + 1] - cu[lo], prefill_counts[lo:hi], need_lse=True
                )
                first_row = sum(prefill_counts[:lo])
                md.prefill_context_rows = (first_row, first_row + sum(prefill_counts[lo:hi]))
                if d == 1:
                    md.prefill.context_lens = torch.tensor(context, device=self.device)
                    md.prefill.block_tables = tables[:num_prefills]
        if md.num_decode_tokens:
            ends = [ch.start + 1 for ch in step.chunks[num_prefills:]]  # the new token is already in the cache
            md.decode = self._paged_kv(
                tables[num_prefills:],
                ends,
                cu[num_prefills:] - prefill_tokens,
                [1] * md.num_decode_tokens,
                need_lse=d > 1,
            )
        self.backend.prepare(md)
        return md

    def _paged_kv(
        self, tables: torch.Tensor, lengths: list[int], query_start: torch.Tensor, counts: list[int], need_lse: bool
    ) -> PagedKV:
        """The cached tokens of each sequence that this rank holds (its DCP shard of the first `lengths`)."""
        c = self.cache_layout
        local = [dcp.local_len(n, self.par.dcp_rank, c.interleave, self.par.dcp_size) for n in lengths]
        return PagedKV(
            block_tables=tables,
            lens=torch.tensor(local, device=self.device),
            query_start=query_start,
            query_counts=counts,
            local_lens=local,
            max_len=max(local),
            block_size=c.block_size,
            need_lse=need_lse,
        )

    def _decode_rows(self, step: ScheduledStep, with_lens: bool = False) -> DecodeRows:
        """A decode-only step's host values on this rank: token, position and slot per sequence, and with
        `with_lens` its local length (the eager path derives those in `_metadata`)."""
        c = self.cache_layout
        rank, d = self.par.dcp_rank, self.par.dcp_size
        chunks = step.chunks
        starts = [ch.start for ch in chunks]
        return DecodeRows(
            input_ids=[ch.token_ids[0] for ch in chunks],
            positions=starts,
            slots=[
                dcp.slot(p, rank, ch.block_table, c.block_size, c.interleave, d)
                for p, ch in zip(starts, chunks, strict=True)
            ],
            local_lens=[dcp.local_len(p + 1, rank, c.interleave, d) for p in starts] if with_lens else [],
            tables=[ch.block_table for ch in chunks],
        )

    def prepare_inputs(self, step: ScheduledStep) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and attention metadata of a (non-empty) step, built once for all layers."""
        chunks = step.chunks
        device = self.device
        c = self.cache_layout
        width = max(len(ch.block_table) for ch in chunks)
        tables = torch.tensor(
            [ch.block_table + [0] * (width - len(ch.block_table)) for ch in chunks], dtype=torch.int64, device=device
        )
        if step.num_prefills == 0:  # one token per chunk: positions and slots from Python ints, no tensor math
            rows = self._decode_rows(step)
            input_ids = torch.tensor(rows.input_ids, device=device)
            positions = torch.tensor(rows.positions, device=device)
            cu = torch.arange(len(chunks) + 1, device=device)
            return input_ids, positions, self._metadata(step, cu, tables, torch.tensor(rows.slots, device=device))
        counts = torch.tensor([len(ch.token_ids) for ch in chunks], device=device)
        starts = torch.tensor([ch.start for ch in chunks], device=device)
        cu = torch.zeros(len(chunks) + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=cu[1:])
        input_ids = torch.tensor(list(itertools.chain.from_iterable(ch.token_ids for ch in chunks)), device=device)
        seq_index = torch.repeat_interleave(torch.arange(len(chunks), device=device), counts)
        positions = starts[seq_index] + torch.arange(input_ids.numel(), device=device) - cu[seq_index]
        slots = dcp.slot(
            positions, self.par.dcp_rank, tables, c.block_size, c.interleave, self.par.dcp_size, rows=seq_index
        )
        return input_ids, positions, self._metadata(step, cu, tables, slots)

    def _pin_threads(self) -> None:
        """Pin the OpenMP team of the thread that steps (the server's engine thread is not the one that started the
        rank) to `thread_cores`; that thread gets its CPU set back once every runner that pinned it released it."""
        self.release_threads()
        self._pinned = threading.get_native_id()
        _THREAD_CPUS.hold(self._pinned)
        bind_threads(self.thread_cores)

    def release_threads(self) -> None:
        """Let go of the stepping thread: the last runner to let go of it gives it its CPU set back (a process that
        goes on, e.g. a test's, starts its children on all its cores again); its OpenMP workers stay pinned for the
        next step."""
        if self._pinned is not None:
            _THREAD_CPUS.release(self._pinned)
            self._pinned = None

    def hand_over_thread(self) -> None:
        """Before another thread steps this runner (a server's engine thread): the calling thread's idle OpenMP
        workers exit, so that the process keeps one team of threads, not one per thread that ever ran torch ops
        (libgomp stops spinning at barriers while it has more threads than cores; `release_openmp_pool`)."""
        if self.device.type == "cpu" and cpu_kernels_available():
            release_openmp_pool()

    @torch.inference_mode()
    def execute(self, step: ScheduledStep) -> StepLogits | None:
        """Run one step; rank 0 gets the logits the step asked for, other ranks None."""
        chunks = step.chunks
        if not chunks:
            return None
        if self.thread_cores is not None and self._pinned != threading.get_native_id():
            self._pin_threads()
        if self._replayable(step):
            logits = self.graphs.run(self._decode_rows(step, with_lens=True))
            return None if logits is None else StepLogits(logits, [(i, 1) for i in range(len(chunks))])
        input_ids, positions, metadata = self.prepare_inputs(step)
        rows, chunk_rows = logit_rows(chunks)
        # every rank picks the same rows (the TP collectives of the last layer's MLP run on them); None: every row, in
        # order (a decode-only step)
        picked = None if len(rows) == input_ids.numel() else torch.tensor(rows, dtype=torch.int64, device=self.device)
        with step_metadata(metadata):
            hidden = self.model(input_ids, positions, picked)
        if self._report_calibration and metadata.prefill is not None:
            self._report_calibration = False
            if self.par.is_driver:
                print(f"dcpctl: {calibration_line(self.kv_scales, metadata.num_prefill_tokens)}", file=sys.stderr)
        if not self.par.computes_logits or not rows:
            return None
        logits = self.model.compute_logits(hidden)
        return None if logits is None else StepLogits(logits=logits, chunk_rows=chunk_rows)


def logit_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[tuple[int, int]]]:
    """The step's rows whose logits rank 0 needs (indices into its flattened tokens, in order), and per chunk
    (first of those rows, count)."""
    rows: list[int] = []
    chunk_rows: list[tuple[int, int]] = []
    offset = 0
    for ch in chunks:
        n, count = len(ch.token_ids), ch.num_logit_rows
        chunk_rows.append((len(rows), count))
        rows.extend(range(offset + n - count, offset + n))
        offset += n
    return rows, chunk_rows
