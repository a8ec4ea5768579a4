"""The plain data rank 0 sends every rank each step: which tokens of which sequences to run."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_transfer.handles import KVPull


@dataclass
class ScheduledChunk:
    """Tokens of one sequence to run this step, at positions start .. start + len(token_ids) - 1."""

    seq_id: int
    token_ids: list[int]
    start: int  # tokens of this sequence already in the KV cache (its context)
    block_table: list[int]
    sample: bool  # the chunk ends the known tokens: sample the next token from its last position
    prompt_logprobs: bool = False  # return logits for every position of the chunk
    num_draft: int = 0  # speculative decoding: the chunk's last `num_draft` tokens are proposals to verify

    @property
    def is_decode(self) -> bool:
        """One new token attending to the cache: the decode path (also a 1-token prefill chunk)."""
        return len(self.token_ids) == 1

    @property
    def num_logit_rows(self) -> int:
        """Positions whose logits rank 0 needs: every one (prompt logprobs), the proposals' and the one before
        them (a verification), the last (a sample), or none (a prompt chunk before the end)."""
        if self.prompt_logprobs:
            return len(self.token_ids)
        return self.num_draft + 1 if self.sample else 0


@dataclass
class ScheduledStep:
    """One engine step: what every rank runs. Prefill chunks (several tokens) come first, then decodes (one token).

    A pulled sequence's chunk is its last prompt token, run after the pull has brought the positions before it.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    pulls: list[KVPull] = field(default_factory=list)  # P/D decode: KV to READ from the prefill side before the run

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_prefills(self) -> int:
        return sum(1 for c in self.chunks if not c.is_decode)
