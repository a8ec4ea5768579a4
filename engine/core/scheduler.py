"""Continuous batching on rank 0: which sequences run each step, within a token budget.

Running sequences go first (a decode costs one token, an unfinished prompt continues in
chunks), then waiting ones join while blocks, `max_num_seqs` and the token budget allow.
A running sequence that cannot get a block preempts the newest running one (recompute: its
blocks are freed and it re-enters the queue at the front with the tokens it has so far).

On a P/D decode instance a waiting sequence whose prompt was computed by the prefill instance is admitted with a
pull: blocks for its whole prompt, a `KVPull` of the positions the prefix cache does not hold (all but the last),
and a one-token chunk for the last position, which the ranks run once the pull is done.

With speculative decoding a decoding sequence's chunk carries up to k proposals after its last token (ngram's, or
places for the draft model's, which the engine's drafter fills in; blocks for them taken only if free); the engine
reports what it accepted (`computed`) and the blocks taken for rejected proposals go back (`rollback`), so the pool
is as if they had never been proposed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.speculative import PENDING_PROPOSAL, propose_ngram
from engine.kv_transfer.handles import LEASE_MARGIN_S, KVPull, KVRole
from engine.plan.resolved import SpeculativeConfig
from engine.runtime.step import ScheduledChunk, ScheduledStep


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    max_model_len: int


class Scheduler:
    """Owns the waiting queue and the running batch; plain Python, no torch."""

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        kv_role: KVRole | None = None,
        speculative: SpeculativeConfig | None = None,
    ):
        self.config = config
        self.blocks = blocks
        self.kv_role = kv_role
        self.speculative = speculative
        self.failed: list[Sequence] = []  # finished with an error while scheduling (taken by the engine)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.peak_running = 0  # the largest batch of running sequences so far

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, release: bool = True) -> None:
        """Mark a sequence finished and give its blocks back (unless `release` is False: an export keeps them)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if release:
            self.blocks.release(seq)

    def requeue(self, seq: Sequence) -> None:
        """Put a running sequence back at the front of the queue with nothing computed (its blocks freed)."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        if seq.draft_cached is not None:  # the draft's KV went with the blocks (a prefix hit brings only the target's)
            seq.draft_cached = 0
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _chunk(self, seq: Sequence, n: int, draft: list[int]) -> ScheduledChunk:
        start = seq.num_computed_tokens
        wants_prompt_logprobs = seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[start : start + n] + draft,
            start=start,
            block_table=list(seq.block_table),
            sample=start + n == len(seq),
            prompt_logprobs=wants_prompt_logprobs,
            num_draft=len(draft),
        )

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Proposals for a decoding sequence, within the token budget, max_tokens and max_model_len, and only where
        the blocks for them are free (speculation never preempts) and the batch is not above disable_by_batch_size;
        the blocks are taken."""
        spec = self.speculative
        if spec is None or seq.num_uncomputed_tokens != 1:
            return []
        if spec.disable_by_batch_size is not None and len(self.running) > spec.disable_by_batch_size:
            return []
        room = min(
            spec.num_speculative_tokens,
            budget - 1,
            seq.params.max_tokens - seq.num_output_tokens - 1,  # the step also yields a token of its own
            self.config.max_model_len - len(seq) - 1,
        )
        if spec.draft is not None:  # the draft model always proposes `room` tokens; they are drafted after scheduling
            draft = [PENDING_PROPOSAL] * room
        else:
            draft = propose_ngram(seq.token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if draft and not self.blocks.grow(seq, len(seq) + len(draft)):
            return []
        return draft

    def _fit(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.chunked_prefill else 0

    def schedule(self) -> tuple[ScheduledStep, list[Sequence]]:
        """Choose this step's chunks; returns the step and the sequences in chunk order."""
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        drafts: dict[int, list[int]] = {}
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = self._fit(seq.num_uncomputed_tokens, budget)
            if n == 0:
                index += 1
                continue
            draft = drafts[seq.seq_id] = self._draft(seq, budget)
            while not draft and not self.blocks.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            picked.append((seq, n))
            budget -= n + len(draft)
            index += 1
        pulls: list[KVPull] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.remote is not None:
                if len(pulls) >= self.kv_role.max_pulls_per_step:
                    break
                if self._lease_too_short(seq):
                    continue
            seq.num_computed_tokens = self.blocks.match_prefix(seq)
            n = 1 if seq.remote is not None else self._fit(seq.num_uncomputed_tokens, budget)
            if n == 0 or not self.blocks.grow(seq, len(seq) if seq.remote is not None else seq.num_computed_tokens + n):
                self.blocks.release(seq)  # hold no blocks while waiting; cached ones stay matchable
                seq.num_computed_tokens = 0
                if not self.running and not picked:
                    raise RuntimeError(f"sequence {seq.request_id!r} of {len(seq)} tokens cannot fit the KV cache")
                break
            self.waiting.popleft()
            if seq.remote is not None:
                pulls.append(self._pull(seq))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.peak_running = max(self.peak_running, len(self.running))
            picked.append((seq, n))
            budget -= n
        # prefill chunks and verifications first, decodes last (stable)
        picked.sort(key=lambda item: item[1] + len(drafts.get(item[0].seq_id, ())) == 1)
        step = ScheduledStep([self._chunk(seq, n, drafts.get(seq.seq_id, [])) for seq, n in picked], pulls)
        return step, [seq for seq, _ in picked]

    def _lease_too_short(self, seq: Sequence) -> bool:
        """Fail a queued pull whose export would expire before its deadline (it waited too long)."""
        if seq.remote.lease_left_s(time.monotonic()) > self.kv_role.transfer_timeout_s + LEASE_MARGIN_S:
            return False
        self.waiting.popleft()
        seq.error = (
            f"the prefill instance {seq.remote.prefill_url}'s export of this prompt expired while it waited here; "
            "raise disagg.lease_s"
        )
        self.finish(seq, "error")
        self.failed.append(seq)
        return True

    def _pull(self, seq: Sequence) -> KVPull:
        """The pull of an admitted remote sequence: the positions before its last one that are not cached here."""
        start, last = seq.num_computed_tokens, len(seq) - 1
        seq.num_computed_tokens = last
        remote, role = seq.remote, self.kv_role
        return KVPull(
            seq.seq_id,
            list(seq.block_table),
            start,
            last,
            remote.source,
            remote.manifest.block_table,
            role.transfer_timeout_s,
            role.measure_raw,
        )

    def take_failed(self) -> list[Sequence]:
        """The sequences that failed while being scheduled, since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def step_done(self, seqs: list[Sequence], step: ScheduledStep, skip: frozenset[int] = frozenset()) -> None:
        """Advance each scheduled sequence by the tokens it computed and register full blocks (not the `skip`
        sequence ids: their pull failed, so their blocks hold no valid KV)."""
        for seq, chunk in zip(seqs, step.chunks, strict=True):
            if seq.seq_id in skip or chunk.num_draft:  # a verification advances by what is accepted (`computed`)
                continue
            seq.num_computed_tokens = chunk.start + len(chunk.token_ids)
            self.blocks.commit(seq)

    def computed(self, seq: Sequence, num_tokens: int) -> None:
        """A verified sequence's first `num_tokens` positions hold KV of its own tokens (the last one before the
        proposals and the accepted ones): advance to them and register the blocks they fill."""
        seq.num_computed_tokens = num_tokens
        self.blocks.commit(seq)

    def rollback(self, seq: Sequence) -> None:
        """After a verification: give back the blocks taken only for rejected proposals. Their KV on every rank
        is past the sequence's computed length, so no later step reads it (each rank's local length and slots
        come from that length through `engine.dcp`), and the next step overwrites it."""
        self.blocks.shrink(seq, seq.num_computed_tokens)
