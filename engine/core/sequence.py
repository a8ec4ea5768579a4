"""Requests as the scheduler sees them: sampling parameters and per-sequence state (plain data)."""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.core.speculative import SpecCounters
from engine.errors import UserError
from engine.kv_transfer.handles import RemotePrefill

MAX_LOGPROBS = 20  # top-N alternatives per token, as OpenAI allows
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes (the end excluded)


@dataclass
class SamplingParams:
    """How to generate for one request (OpenAI / vLLM semantics; temperature 0 is greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: Collection[int] = frozenset()  # held as a frozenset: every sampled token is looked up in it
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs for each generated token (0: only the sampled token)
    prompt_logprobs: int | None = None  # top-N logprobs for each prompt token (the first has none)

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.stop_token_ids)  # the same object when it already is one

    def validate(self) -> None:
        """Raise UserError naming the first bad value."""
        if self.max_tokens < 0:
            raise UserError(f"max_tokens={self.max_tokens} must be >= 0")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature={self.temperature} must be a finite number >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise UserError(f"top_k={self.top_k} must be -1, 0 (off) or a positive count")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise UserError(f"{name}={value} must be between 0 and {MAX_LOGPROBS}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise UserError(f"seed={self.seed} does not fit in 64 bits; use a smaller seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The logprob of a chosen token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


_seq_counter = itertools.count()


class Sequence:
    """One request's tokens, cache blocks and progress. Owned by rank 0's scheduler."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None):
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # why it failed (finish_reason "error")
        self.output_text = ""
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.num_preemptions = 0
        self.spec: SpecCounters | None = None  # speculative decoding's proposals and acceptances (None: off)
        self.draft_cached: int | None = None  # draft_model: positions of valid draft KV from the start (None: none)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # incremental detokenization offsets (see Detokenizer)
        self.prefix_offset = 0
        self.read_offset = 0
        # prefill -> decode hand-off
        self.export = False  # prefill side: keep the prompt's blocks for a decode instance when finished
        self.transfer_id: str | None = None  # prefill side: the export's id, once kept
        self.remote: RemotePrefill | None = None  # decode side: the prompt's KV comes from a prefill instance
        self.kv_transfer: dict | None = None  # decode side: what the pull did (the response reports it)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
