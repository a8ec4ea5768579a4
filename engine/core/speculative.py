"""Speculative decoding on rank 0 (plain data, no torch): the ngram (prompt lookup) proposer and the counters.

A running sequence with one token left to compute gets up to k proposals appended to its decode chunk (with a draft
model, `PENDING_PROPOSAL` places that `engine.core.drafter` fills in before the step is sent); the ranks
run the k + 1 tokens as one multi-token chunk through the ordinary paged path (cached context + new tokens, on
every layout), and the engine accepts a prefix of the proposals plus one token of its own (`engine.core.sampler.
verify`). The scheduler rolls back what the rejected proposals took (`Scheduler.accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

PENDING_PROPOSAL = -1  # a proposal the draft model has yet to make (the scheduler sizes the step, the drafter fills it)


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the sequence's last n tokens (vLLM's prompt lookup).

    The longest n in [min_n, max_n] whose suffix n-gram occurs earlier (ending before the last token) wins, and of
    its occurrences the earliest; the proposal is what followed it, fewer than `k` tokens where the sequence ends
    sooner. Empty: no occurrence, or `k` < 1.
    """
    total = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        first = suffix[0]
        i = -1
        while True:
            try:
                i = tokens.index(first, i + 1, total - n)
            except ValueError:
                break
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


@dataclass
class SpecCounters:
    """Proposals made and accepted: per request (on its Sequence) and for the engine."""

    proposed: int = 0  # proposal tokens verified
    accepted: int = 0  # of those, accepted
    verifications: int = 0  # steps that verified proposals (each also yields one token of the model's own)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1

    @classmethod
    def since(cls, before: dict | None, after: dict) -> SpecCounters:
        """What was counted between two `as_dict` snapshots (`before` None: since the start)."""
        before = before or {}
        fields = ("proposed", "accepted", "verifications")
        return cls(*(after[f] - before.get(f, 0) for f in fields))

    def as_dict(self) -> dict[str, float | int | None]:
        """proposed, accepted, verifications, acceptance_rate (accepted / proposed) and mean_accepted_length (tokens
        a verification yields, the model's own included: vLLM's mean acceptance length); None where nothing was
        proposed."""
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "verifications": self.verifications,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "mean_accepted_length": (
                (self.accepted + self.verifications) / self.verifications if self.verifications else None
            ),
        }
