"""Rank 0's engine loop: admit requests, schedule a step, send it to every rank, sample, finish.

`LLMEngine` owns the tokenizer, the scheduler and the block manager; the model runner (one per rank, built by
`engine.core.startup`) executes the steps. Only rank 0 keeps per-request state.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.detokenizer import Detokenizer
from engine.core.handoff import Handoff
from engine.core.sampler import INVALID, sample, token_logprobs, verify
from engine.core.scheduler import Scheduler
from engine.core.sequence import SamplingParams, Sequence
from engine.core.speculative import SpecCounters
from engine.distributed import ParallelContext, broadcast_object
from engine.errors import UserError
from engine.kv_transfer.handles import RankEndpoint, RemotePrefill
from engine.runtime.model_runner import ModelRunner, StepLogits
from engine.runtime.step import ScheduledChunk, ScheduledStep

logger = logging.getLogger("dcpctl.engine")


def load_tokenizer(folder: Path):
    """The checkpoint's HF tokenizer; a UserError naming the folder when its tokenizer files are missing or broken."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (ValueError, OSError) as exc:  # json.JSONDecodeError is a ValueError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{folder}: its tokenizer cannot be loaded ({reason}); the folder needs a valid tokenizer.json "
            "(and tokenizer_config.json): copy them from the model's repository"
        ) from None


def _eos_ids(folder: Path, hf_config, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list | tuple) else {int(eos)}


@dataclass
class EngineCounters:
    """What the engine has done since it started."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


def prompt_too_long(tokens: str, max_model_len: int) -> str:
    """Why a prompt of `tokens` tokens (a count, or what is known of it) cannot run: it leaves no room to generate."""
    return (
        f"the prompt has {tokens} tokens but the plan's max_model_len is {max_model_len}; "
        "shorten the prompt or raise model.max_model_len"
    )


class LLMEngine:
    """The driver: owns tokenizer, scheduler and block manager; runs steps on every rank."""

    def __init__(
        self,
        config: EngineConfig,
        par: ParallelContext,
        runner: ModelRunner,
        prefill_ranks: list[RankEndpoint] | None = None,
    ):
        self.config = config
        self.par = par
        self.runner = runner
        self.tokenizer = load_tokenizer(config.model_path)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_ids = _eos_ids(config.model_path, runner.hf_config, self.tokenizer)
        cache = runner.cache_layout
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, par.dcp_size, config.prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, config.kv_role, config.speculative)
        self.handoff = Handoff.for_role(config, par, self.blocks, prefill_ranks)
        self.drafter = None  # draft_model speculation: the draft model, run here on rank 0 (engine.core.drafter)
        if config.speculative is not None and config.speculative.draft is not None:
            from engine.core.drafter import Drafter

            self.drafter = Drafter(config, par, cache.num_blocks, self.blocks.span)
        self.requests: dict[str, Sequence] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.counters = EngineCounters()
        self.spec_counters = SpecCounters()
        self._ids = itertools.count()
        self._stopped = False

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids as the model's tokenizer makes them by default (special tokens as HF adds them)."""
        return self.tokenizer(prompt).input_ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        export: bool = False,
        remote: RemotePrefill | None = None,
    ) -> Sequence:
        """Queue a request; a UserError says why it cannot run (bad parameters, too long).

        P/D: `export` (a prefill instance) keeps the prompt's KV blocks for a decode instance when the request
        finishes; `remote` (a decode instance) pulls the prompt's KV from the prefill instance instead of
        computing it.
        """
        params.validate()
        self.handoff.check_request(export, remote, params)
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise UserError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise UserError(prompt_too_long(str(len(ids)), self.max_model_len))
        vocab = self.runner.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise UserError(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, prompt=text)
        seq.export, seq.remote = export, remote
        if self.config.speculative is not None:
            seq.spec = SpecCounters()
        if self.drafter is not None:
            seq.draft_cached = 0
        if params.seed is not None:
            self.generators[seq.seq_id] = torch.Generator(device=self.par.device).manual_seed(params.seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.counters.prompt_tokens += len(ids)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (no-op if it already finished)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort", flush=False)  # nobody reads its text: nothing to detokenize (or fail)

    def housekeeping(self) -> float | None:
        """Free the exports whose lease ran out; seconds until the next one does (None: nothing to wait for)."""
        exports = self.handoff.exports
        if exports is None:
            return None
        exports.expire()
        return exports.next_expiry_s()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> dict[str, Any]:
        """KV blocks (used, free, peak), batch sizes and token counters, as of now (and the P/D hand-off's)."""
        blocks, scheduler, counters = self.blocks, self.scheduler, self.counters
        return {
            **self.handoff.stats(),
            "num_blocks": blocks.num_blocks,
            "used_blocks": blocks.num_used_blocks,
            "free_blocks": blocks.num_free_blocks,
            "peak_used_blocks": blocks.peak_used,
            "tokens_per_block": blocks.span,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "peak_running": scheduler.peak_running,
            "steps": counters.steps,
            "prompt_tokens": counters.prompt_tokens,
            "generated_tokens": counters.generated_tokens,
            "preemptions": scheduler.num_preemptions,
            "prefix_hit_tokens": blocks.prefix_hit_tokens,
            **({"speculative": self.spec_counters.as_dict()} if self.config.speculative is not None else {}),
        }

    def _finish(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        if flush:
            self.detokenizer.step(seq, final=True)
        keep = seq.export and reason in ("length", "stop")
        self.scheduler.finish(seq, reason, release=not keep)
        if keep:
            seq.transfer_id = self.handoff.exports.keep(seq)
        self.generators.pop(seq.seq_id, None)
        self.requests.pop(seq.request_id, None)
        seq.finish_time = time.perf_counter()

    def step(self) -> list[Sequence]:
        """Run one step on every rank; returns the sequences that got a token or finished."""
        scheduled, seqs = self.scheduler.schedule()
        failed = self.scheduler.take_failed()
        if not scheduled.chunks:
            return failed
        if self.drafter is not None:
            self.drafter.propose(scheduled, seqs, self.generators)
        broadcast_object(scheduled, self.par.control_group)
        self.handoff.step_started()
        reports = self.runner.receive(scheduled)
        self.handoff.pulls_done()
        result = self.runner.execute(scheduled)
        pulled = self.handoff.pulled(scheduled, seqs, reports)
        self.scheduler.step_done(seqs, scheduled, skip=pulled.failed)
        for seq in pulled.failed_seqs:
            if self.handoff.recompute_failed:
                seq.remote = None
                self.scheduler.requeue(seq)
            else:
                self._finish(seq, "error", flush=False)
                failed.append(seq)
        self.counters.steps += 1
        return failed + self._process(scheduled, seqs, result, skip=pulled.failed)

    def _process(
        self, scheduled: ScheduledStep, seqs: list[Sequence], result: StepLogits | None, skip: frozenset[int]
    ) -> list[Sequence]:
        """Sample, detokenize and check stops for the step's sequences.

        A failure in that work for one sequence finishes only that sequence (finish_reason "error", blocks freed);
        the batch goes on. The other ranks need no word of it: they keep no per-sequence state, and the failed
        sequence is simply absent from the next step.
        """
        updated: list[Sequence] = []
        sampled_rows, sampled_seqs = [], []
        for i, (seq, chunk) in enumerate(zip(seqs, scheduled.chunks, strict=True)):
            if seq.seq_id in skip:
                continue
            first, count = result.chunk_rows[i] if result else (0, 0)
            if chunk.prompt_logprobs and count:
                try:
                    self._record_prompt_logprobs(seq, chunk.start, result.logits[first : first + count])
                except Exception as exc:
                    self._fail(seq, "computing prompt logprobs", exc)
                    updated.append(seq)
                    continue
            if chunk.sample and chunk.num_draft:
                updated.append(seq)
                self._verify(seq, chunk, result.logits[first : first + count])
            elif chunk.sample:
                sampled_rows.append(first + count - 1)
                sampled_seqs.append(seq)
        if not sampled_seqs:
            return updated
        logits = result.logits[sampled_rows]
        tokens = self._sample(logits, sampled_seqs)
        for row, (seq, token) in enumerate(zip(sampled_seqs, tokens, strict=True)):
            updated.append(seq)
            if isinstance(token, Exception):
                self._fail(seq, "sampling", token)
                continue
            if seq.params.max_tokens == 0 and token != INVALID:
                self._finish(seq, "length")
                continue
            self._emit(seq, token, logits[row : row + 1])
        return updated

    def _emit(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """Append a sampled token (its logprobs from `logits` [1, V]) and check the stops; a failure finishes only
        this sequence."""
        if token == INVALID:
            self._fail(seq, "sampling", "the next-token distribution has NaN or infinite values")
            return
        try:
            if seq.params.logprobs is not None:
                seq.logprobs.extend(token_logprobs(logits, [token], seq.params.logprobs))
            seq.token_ids.append(token)
            self.counters.generated_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
                self.handoff.first_token(seq, seq.first_token_time)
            self._check_stop(seq, token)
        except Exception as exc:
            if seq.is_finished:  # it failed after the scheduler released it: the engine's own state is suspect
                raise
            self._fail(seq, "detokenizing or checking stops", exc)

    def _verify(self, seq: Sequence, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Accept a prefix of the chunk's proposals plus one token (`sampler.verify`), one token at a time as a
        decode would (stops, max_tokens and EOS can end it inside the run), then roll back the rest."""
        draft = chunk.token_ids[-chunk.num_draft :]
        draft_probs = self.drafter.take(seq.seq_id) if self.drafter is not None else None
        try:
            tokens = verify(logits, draft, seq.params, self.generators.get(seq.seq_id), draft_probs)
        except Exception as exc:
            self._fail(seq, "sampling", exc)
            return
        accepted = len(tokens) - 1
        seq.spec.record(len(draft), accepted)
        self.spec_counters.record(len(draft), accepted)
        for j, token in enumerate(tokens):
            # KV is valid through the j-th accepted proposal: exactly what a decode of the same tokens would hold
            self.scheduler.computed(seq, chunk.start + 1 + j)
            self._emit(seq, token, logits[j : j + 1])
            if seq.is_finished:
                return
        self.scheduler.rollback(seq)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        """A token (or `INVALID`) per row; if the batch raises, each row alone, so only the rows at fault fail."""
        params = [s.params for s in seqs]
        generators = [self.generators.get(s.seq_id) for s in seqs]
        try:
            return sample(logits, params, generators).tolist()
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
        tokens: list[int | Exception] = []
        for row in range(len(seqs)):
            try:
                tokens.append(int(sample(logits[row : row + 1], params[row : row + 1], generators[row : row + 1])[0]))
            except Exception as exc:
                tokens.append(exc)
        return tokens

    def _fail(self, seq: Sequence, stage: str, error: Exception | str) -> None:
        """Finish one sequence with finish_reason "error" and the reason; its blocks are freed."""
        exc_info = error if isinstance(error, Exception) else None
        if exc_info is not None:
            error = f"{type(error).__name__}: {error}"
        logger.error("request %s failed while %s: %s", seq.request_id, stage, error, exc_info=exc_info)
        seq.error = f"{stage} failed: {error}"
        self._finish(seq, "error", flush=False)

    def _record_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has no logprob
        rows, targets = [], []
        for i in range(logits.shape[0]):
            position = start + i + 1
            if position < seq.num_prompt_tokens and position == len(seq.prompt_logprobs) + len(rows):
                rows.append(i)
                targets.append(seq.token_ids[position])
        if rows:
            seq.prompt_logprobs.extend(token_logprobs(logits[rows], targets, seq.params.prompt_logprobs))

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        new_text = self.detokenizer.step(seq)
        if not params.ignore_eos and token in self.eos_ids:
            return self._finish(seq, "stop")
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return self._finish(seq, "stop")
        if params.stop and new_text:
            text = seq.output_text
            longest = max(len(s) for s in params.stop)
            window_start = max(0, len(text) - len(new_text) - longest + 1)
            hits = [(text.find(s, window_start), s) for s in params.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                seq.output_text = text[:index]
                seq.stop_reason = stop
                return self._finish(seq, "stop", flush=False)
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return self._finish(seq, "length")
        return None

    def hand_over_thread(self) -> None:
        """Call before another thread steps this engine (`ModelRunner.hand_over_thread`)."""
        self.runner.hand_over_thread()

    def shutdown(self) -> None:
        """Tell the other ranks to stop (idempotent)."""
        if not self._stopped:
            self._stopped = True
            broadcast_object(None, self.par.control_group)
            self.runner.release_threads()
