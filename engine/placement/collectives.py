"""The collectives a plan runs per decoder layer and per step, with the bytes each rank sends per decode token.

Bytes sent per rank for a payload of S bytes over n ranks (ring algorithms): all-reduce 2(n-1)/n * S, all-gather
(n-1) * s for an s-byte contribution, reduce-scatter (n-1)/n * S, all-to-all the chunks for the other ranks,
gather the contribution of each sender. A group of one rank runs nothing. On CPU (gloo) the count of collectives
per step decides their cost far more than their bytes (docs/results/collectives.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.placement.split import DensePlacement, ModuleSplit, attended_heads

LSE_BYTES = 4  # log-sum-exps travel in fp32
PARTIAL_BYTES = 4  # ag_rs reduce-scatters the LSE-weighted partial outputs in fp32
LOGIT_BYTES = 4  # the LM head's logits are gathered in fp32


@dataclass(frozen=True)
class Collective:
    """One collective: where it runs, over which group, and the bytes each rank sends per decode token."""

    where: str  # "attention: query gather", "attention: combine", "o_proj", "mlp", "moe", "embedding", "lm head"
    layers: range | None  # the decoder layers that run it once each; None: once per step
    op: str  # all_gather, reduce_scatter, all_to_all, all_reduce, gather
    group: str  # query, dcp, tp, world
    ranks: int
    bytes_per_token: int


def collectives(placement: DensePlacement, dtype_bytes: int) -> list[Collective]:
    """Every collective of a decode step, in the order a layer runs them, then the per-step ones."""
    layout, m = placement.layout, placement.model
    all_layers = range(m.num_layers)
    out: list[Collective] = []
    span, d = layout.q_span, layout.dcp
    share = placement.rank(0)
    if share.gather_queries:
        key_dim = m.kv_lora_rank + m.qk_rope_head_dim if m.is_mla else m.head_dim
        payload = len(share.q_heads) * key_dim * dtype_bytes
        out.append(Collective("attention: query gather", all_layers, "all_gather", "query", span, (span - 1) * payload))
    if d > 1:
        heads, width = attended_heads(layout), share.merge_width
        if placement.comm_backend == "a2a":
            chunk = width * dtype_bytes + heads * LSE_BYTES
            out.append(Collective("attention: combine", all_layers, "all_to_all", "dcp", d, (d - 1) * chunk))
        else:
            out += [
                Collective("attention: combine (LSE)", all_layers, "all_gather", "dcp", d, (d - 1) * heads * LSE_BYTES),
                Collective(
                    "attention: combine", all_layers, "reduce_scatter", "dcp", d, (d - 1) * width * PARTIAL_BYTES
                ),
            ]
    hidden = m.hidden_size * dtype_bytes
    for split in (placement.o_proj, placement.mlp, placement.moe):
        if split is not None:
            out += _all_reduce(split, split.module, split.layers, hidden)
    out += _all_reduce(placement.vocab, "embedding", None, hidden)
    vocab = placement.vocab
    if vocab.parts > 1:
        rows, _ = placement.rank(0).vocab.padded(m.vocab_size)
        out.append(Collective("lm head", None, "gather", vocab.group, vocab.parts, rows * LOGIT_BYTES))
    return out


def _all_reduce(split: ModuleSplit, where: str, layers: range | None, payload: int) -> list[Collective]:
    n = split.parts
    if n == 1:
        return []
    return [Collective(where, layers, "all_reduce", split.group, n, 2 * (n - 1) * payload // n)]


def per_step_count(items: list[Collective]) -> int:
    """Collectives one decode step runs (each per-layer one once per layer, plus the per-step ones)."""
    return sum(len(c.layers) if c.layers is not None else 1 for c in items)
