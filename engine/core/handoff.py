"""Rank 0's part in a prefill -> decode deployment (plain data).

A prefill instance keeps finished prompts' blocks as exports and describes itself (`PrefillInfo`) to decode
instances. A decode instance accepts requests whose prompt was computed there, and after each step that pulled
KV it turns the ranks' reports into the sequences' fate (failed pulls) and into the hand-off's statistics.
Without a P/D role every hook is a no-op.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.exports import Exports
from engine.core.sequence import SamplingParams, Sequence
from engine.dcp import DcpSpec
from engine.distributed import ParallelContext
from engine.errors import UserError
from engine.kv_transfer.handles import KVRole, PrefillInfo, PullReport, RankEndpoint, RemotePrefill, fingerprint
from engine.runtime.step import ScheduledStep


@dataclass
class PulledStep:
    """The sequences of a step whose pull failed on some rank."""

    failed: frozenset[int] = frozenset()
    failed_seqs: list[Sequence] = field(default_factory=list)


@dataclass
class _RankTotals:
    descriptors: int = 0
    bytes: int = 0
    transfer_s: float = 0.0


class Handoff:
    """The engine's P/D role: exports on a prefill instance, pull accounting on a decode instance."""

    def __init__(self, role: KVRole | None, exports: Exports | None = None, info: PrefillInfo | None = None):
        self.role = role
        self.exports = exports
        self.info = info
        self.pulls = 0
        self.pulls_failed = 0
        self.pull_tokens = 0
        self.descriptors = 0
        self.bytes = 0
        self.transfer_s = 0.0
        self.raw_transfer_s = 0.0
        self.last_error: str | None = None
        self.ranks: dict[int, _RankTotals] = {}
        self._step_started = self._pulls_done = 0.0

    @classmethod
    def for_role(
        cls, config: EngineConfig, par: ParallelContext, blocks: BlockManager, ranks: list[RankEndpoint] | None
    ) -> Handoff:
        role = config.kv_role
        if role is None or role.role != "prefill":
            return cls(role)
        info = PrefillInfo(
            engine_id=uuid.uuid4().hex,
            fingerprint=fingerprint(config.model, config.cache_dtype),
            tp=par.tp_size,
            dcp=par.dcp_size,
            spec=DcpSpec(config.block_size, config.interleave, par.dcp_size),
            ranks=list(ranks or []),
        )
        return cls(role, Exports(blocks, role.lease_s), info)

    @property
    def is_decode(self) -> bool:
        return self.role is not None and self.role.role == "decode"

    @property
    def recompute_failed(self) -> bool:
        """A failed pull recomputes the prompt here (failure_policy recompute) instead of failing the request."""
        return self.is_decode and self.role.failure_policy == "recompute"

    def check_request(self, export: bool, remote: RemotePrefill | None, params: SamplingParams) -> None:
        """A UserError for a hand-off this instance cannot take part in."""
        if export and self.exports is None:
            raise UserError("this instance is not a prefill instance of a P/D deployment: it cannot export KV")
        if remote is not None:
            if not self.is_decode:
                raise UserError("this instance is not a decode instance of a P/D deployment: it cannot pull KV")
            if params.prompt_logprobs is not None:
                raise UserError("prompt logprobs need the prompt computed here; send the request without a hand-off")

    def step_started(self) -> None:
        self._step_started = time.perf_counter()

    def pulls_done(self) -> None:
        self._pulls_done = time.perf_counter()

    def pulled(self, step: ScheduledStep, seqs: list[Sequence], reports: list[PullReport] | None) -> PulledStep:
        """Account for the step's pulls (the ranks' reports, on rank 0); which sequences' pulls failed."""
        if not step.pulls or reports is None:
            return PulledStep()
        by_seq: dict[int, list[PullReport]] = {}
        for report in reports:
            by_seq.setdefault(report.seq_id, []).append(report)
        seq_of = {s.seq_id: s for s in seqs}
        out = PulledStep()
        failed = set()
        for pull in step.pulls:
            seq, mine = seq_of[pull.seq_id], by_seq.get(pull.seq_id, [])
            self.pulls += 1
            errors = [r for r in mine if r.error]
            for r in mine:
                totals = self.ranks.setdefault(r.rank, _RankTotals())
                totals.descriptors += r.descriptors
                totals.bytes += r.bytes
                totals.transfer_s += r.seconds
            transfer_s = max((r.seconds for r in mine), default=0.0)
            seq.kv_transfer = {
                "transfer_id": seq.remote.manifest.transfer_id,
                "queue_s": self._step_started - seq.arrival_time,
                "transfer_s": transfer_s,
                "descriptors": sum(r.descriptors for r in mine),
                "bytes": sum(r.bytes for r in mine),
                "tokens": pull.end - pull.start,
                "per_rank": [
                    {"rank": r.rank, "descriptors": r.descriptors, "bytes": r.bytes, "transfer_s": r.seconds}
                    | ({"raw_transfer_s": r.raw_seconds} if r.raw_seconds is not None else {})
                    for r in sorted(mine, key=lambda r: r.rank)
                ],
            }
            if errors:
                first = errors[0]
                self.pulls_failed += 1
                self.last_error = seq.error = (
                    f"the KV transfer from the prefill instance {seq.remote.prefill_url} failed on decode rank "
                    f"{first.rank}: {first.error}"
                )
                seq.kv_transfer["error"] = seq.error
                failed.add(seq.seq_id)
                out.failed_seqs.append(seq)
                continue
            self.pull_tokens += pull.end - pull.start
            self.descriptors += seq.kv_transfer["descriptors"]
            self.bytes += seq.kv_transfer["bytes"]
            self.transfer_s += transfer_s
            raw = [r.raw_seconds for r in mine if r.raw_seconds is not None]
            if raw:
                seq.kv_transfer["raw_transfer_s"] = max(raw)
                self.raw_transfer_s += max(raw)
            seq.remote = None  # pulled: from here on an ordinary sequence (a preemption recomputes it here)
        out.failed = frozenset(failed)
        return out

    def first_token(self, seq: Sequence, now: float) -> None:
        """A pulled sequence's first token: the time from the end of its pull to it is its first decode."""
        info = seq.kv_transfer
        if info is not None and "error" not in info:
            info["first_decode_s"] = now - self._pulls_done

    def stats(self) -> dict[str, Any]:
        if self.exports is not None:
            return {"engine_id": self.info.engine_id, **self.exports.stats()}
        if not self.is_decode:
            return {}
        return {
            "kv_transfer": {
                "pulls": self.pulls,
                "pulls_failed": self.pulls_failed,
                "pull_tokens": self.pull_tokens,
                "descriptors": self.descriptors,
                "bytes": self.bytes,
                "transfer_s": self.transfer_s,
                "raw_transfer_s": self.raw_transfer_s,
                "last_error": self.last_error,
                "ranks": [
                    {"rank": rank, "descriptors": t.descriptors, "bytes": t.bytes, "transfer_s": t.transfer_s}
                    for rank, t in sorted(self.ranks.items())
                ],
            }
        }
