"""Speculative decoding's draft model (method draft_model) on rank 0: a second, smaller checkpoint of the target's
tokenizer, run by the engine's own model code with its own paged KV cache.

Where it runs, and why: unsharded (a world of one: tp 1, dcp 1) on the driver rank only. Rank 0 is where proposals
are wanted (the scheduler and the verifier live there); a draft small enough to pay for itself gains nothing from
sharding that would not be lost to a collective per draft token; and the other ranks receive its proposals inside
the step plan, as they receive ngram's. Its cache uses the target's block ids: draft block b holds the draft's KV of
the positions the target's virtual block b covers (block_size x dcp tokens), so the block manager's allocation,
preemption and rollback govern both caches at once. A prefix-cache hit carries only the target's KV: the draft
computes a sequence from its start (`draft_cached` is 0 for a new or requeued sequence).

The draft runs only in steps that propose, and only for the sequences that verify: while the scheduler proposes
nothing (above disable_by_batch_size, a prompt chunk, no room left) it costs nothing, and a sequence catches up on
the tokens it skipped at its next verification. Then pass 1 runs, for each verifying chunk, the tokens the draft has
not cached up to the chunk's last known token (one after a verification that rejected a proposal, two after one that
accepted every proposal, all of them at a sequence's first verification, those since the last after a pause) and
takes the logits of that last token: its first proposal. Passes 2..k feed each proposal back (one-token decodes) for
the next. `Sequence.draft_cached` counts the positions of valid draft KV from the start; where it runs past the
target's computed tokens (rejected proposals), the next pass 1 starts at the target's count and overwrites them.
"""

from __future__ import annotations

import torch

from engine.attention.registry import create_backend
from engine.checkpoints.config_values import read_config
from engine.core.config import EngineConfig
from engine.core.sampler import distribution, greedy
from engine.core.sequence import Sequence
from engine.distributed import ParallelContext, single_context, using_parallel
from engine.parallel_layout import ParallelLayout
from engine.placement.split import DensePlacement
from engine.runtime.model_runner import TORCH_DTYPES, CacheLayout, ModelRunner
from engine.runtime.step import ScheduledChunk, ScheduledStep


class Drafter:
    """The draft model's runner on rank 0 and the proposals of the current step (with their distributions)."""

    def __init__(self, config: EngineConfig, par: ParallelContext, num_blocks: int, span: int):
        draft = config.speculative.draft
        info = draft.info
        layout = ParallelLayout.build(1, 1, info.num_heads, info.num_kv_heads, info.is_mla)
        self.par = single_context(DensePlacement.build(layout, info), par.device)
        with using_parallel(self.par):
            self.runner = ModelRunner(
                read_config(draft.path),
                draft.path,
                self.par,
                TORCH_DTYPES[config.dtype],
                create_backend(config.attention_backend),
                config.max_model_len,
            )
        # one draft block per virtual block of the target (dcp 1: the block is its own interleave)
        cache_dtype = TORCH_DTYPES[config.cache_dtype]
        self.runner.allocate_cache(CacheLayout(num_blocks, span, span, cache_dtype, config.calculate_kv_scales))
        self.probs: dict[int, torch.Tensor] = {}  # seq_id -> the draft's distributions of its proposals (sampled)

    def propose(self, step: ScheduledStep, seqs: list[Sequence], generators: dict[int, torch.Generator]) -> None:
        """Fill in each verifying chunk's proposals (the scheduler leaves `num_draft` placeholders), first bringing
        the draft's cache up to its known tokens: greedy rows take the draft's argmax, sampled rows draw from the
        draft's distribution under the request's parameters and generator (kept for `take`). A step without a
        verifying chunk runs no draft forward."""
        self.probs = {}
        verifying = [(seq, chunk) for seq, chunk in zip(seqs, step.chunks, strict=True) if chunk.num_draft]
        if not verifying:
            return
        catch_up: list[ScheduledChunk] = []
        for seq, chunk in verifying:
            known = chunk.start + len(chunk.token_ids) - chunk.num_draft
            start = min(seq.draft_cached, chunk.start)
            catch_up.append(ScheduledChunk(seq.seq_id, seq.token_ids[start:known], start, chunk.block_table, True))
            seq.draft_cached = known
        # the runner takes multi-token chunks first; the logits come back in that order
        catch_up.sort(key=ScheduledChunk.is_decode.fget)
        logits = self._run(catch_up)
        order = {c.seq_id: i for i, c in enumerate(catch_up)}
        logits = logits[[order[seq.seq_id] for seq, _ in verifying]]
        proposals: list[list[int]] = [[] for _ in verifying]
        q_rows: list[list[torch.Tensor]] = [[] for _ in verifying]
        active = list(range(len(verifying)))
        for j in range(max((c.num_draft for _, c in verifying), default=0)):
            if j:
                chunks = [verifying[i][1] for i in active]
                logits = self._run(
                    [
                        ScheduledChunk(c.seq_id, [proposals[i][-1]], c.start + j, c.block_table, True)
                        for i, c in zip(active, chunks, strict=True)
                    ]
                )
            tokens = self._draw(logits, [verifying[i][0] for i in active], generators, [q_rows[i] for i in active])
            for i, token in zip(active, tokens, strict=True):
                proposals[i].append(token)
            active = [i for i in active if verifying[i][1].num_draft > j + 1]
        for (seq, chunk), drafted, q in zip(verifying, proposals, q_rows, strict=True):
            chunk.token_ids[-chunk.num_draft :] = drafted
            seq.draft_cached = chunk.start + chunk.num_draft  # the last proposal's KV is never written
            if q:
                self.probs[seq.seq_id] = torch.stack(q)

    def take(self, seq_id: int) -> torch.Tensor | None:
        """The draft's distributions [k, V] of a sampled sequence's proposals this step (None: greedy)."""
        return self.probs.pop(seq_id, None)

    def _run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The draft's logits of the chunks' sampled rows (in chunk order), the KV of all their tokens written."""
        result = self.runner.execute(ScheduledStep(chunks))
        return result.logits if result is not None else torch.empty(0)

    def _draw(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        generators: dict[int, torch.Generator],
        q_rows: list[list[torch.Tensor]],
    ) -> list[int]:
        """One proposal per row: the argmax for greedy requests; for sampled ones a draw from the draft's
        distribution (appended to the row's `q_rows`)."""
        tokens = greedy(logits).tolist()
        sampled = [n for n, seq in enumerate(seqs) if not seq.params.greedy]
        if not sampled:
            return tokens
        probs, _ = distribution(logits[sampled], [seqs[n].params for n in sampled])
        for row, n in enumerate(sampled):
            tokens[n] = int(torch.multinomial(probs[row], 1, generator=generators.get(seqs[n].seq_id))[0])
            q_rows[n].append(probs[row])
        return tokens
