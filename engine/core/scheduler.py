"""Continuous batching on rank 0: which sequences run each step, within a token budget.

Running sequences go first (a decode costs one token, an unfinished prompt continues in
chunks), then waiting ones join while blocks, `max_num_seqs` and the token budget allow.
A running sequence that cannot get a block preempts the newest running one (recompute: its
blocks are freed and it re-enters the queue at the front with the tokens it has so far).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence, SequenceStatus
from engine.runtime.step import ScheduledChunk, ScheduledStep


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    max_model_len: int


class Scheduler:
    """Owns the waiting queue and the running batch; plain Python, no torch."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.peak_running = 0  # the largest batch of running sequences so far

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished and give its blocks back."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        wants_prompt_logprobs = seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[start : start + n],
            start=start,
            block_table=list(seq.block_table),
            sample=start + n == len(seq),
            prompt_logprobs=wants_prompt_logprobs,
        )

    def _fit(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.chunked_prefill else 0

    def schedule(self) -> tuple[ScheduledStep, list[Sequence]]:
        """Choose this step's chunks; returns the step and the sequences in chunk order."""
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = self._fit(seq.num_uncomputed_tokens, budget)
            if n == 0:
                index += 1
                continue
            while not self.blocks.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            picked.append((seq, n))
            budget -= n
            index += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            seq.num_computed_tokens = self.blocks.match_prefix(seq)
            n = self._fit(seq.num_uncomputed_tokens, budget)
            if n == 0 or not self.blocks.grow(seq, seq.num_computed_tokens + n):
                self.blocks.release(seq)  # hold no blocks while waiting; cached ones stay matchable
                seq.num_computed_tokens = 0
                if not self.running and not picked:
                    raise RuntimeError(f"sequence {seq.request_id!r} of {len(seq)} tokens cannot fit the KV cache")
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.peak_running = max(self.peak_running, len(self.running))
            picked.append((seq, n))
            budget -= n
        picked.sort(key=lambda item: item[1] == 1)  # prefill chunks first, decodes last (stable)
        step = ScheduledStep([self._chunk(seq, n) for seq, n in picked])
        return step, [seq for seq, _ in picked]

    def step_done(self, seqs: list[Sequence], step: ScheduledStep) -> None:
        """Advance each scheduled sequence by the tokens it computed and register full blocks."""
        for seq, chunk in zip(seqs, step.chunks, strict=True):
            seq.num_computed_tokens = chunk.start + len(chunk.token_ids)
            self.blocks.commit(seq)
