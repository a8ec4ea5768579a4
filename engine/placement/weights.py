"""The weights one rank holds under a placement: every parameter tensor the engine allocates, by module.

Exact to the engine's allocation (the MoE router is fp32 whatever the model dtype; a vocabulary slice is padded to
ceil(V / parts) rows; a tied LM head is the embedding). At tp=1, dcp=1 the shares sum to the checkpoint's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.placement.split import DensePlacement, RankPlacement


@dataclass(frozen=True)
class WeightShare:
    """One kind of tensor on a rank: `elements` in each of `copies` layers (1 for the model's own tensors)."""

    module: str
    copies: int
    elements: int
    fp32: bool = False  # kept in fp32 whatever the model dtype

    def bytes(self, dtype_bytes: int) -> int:
        return self.copies * self.elements * (4 if self.fp32 else dtype_bytes)


def weight_shares(placement: DensePlacement, rank: int) -> list[WeightShare]:
    """Every tensor kind rank `rank` allocates."""
    m = placement.model
    share = placement.rank(rank)
    hidden, layers = m.hidden_size, m.num_layers
    shares = [*_attention(placement, share), WeightShare("norms", layers, 2 * hidden)]
    dense_layers = len(placement.mlp.layers) if placement.mlp else 0
    if dense_layers:
        local = m.intermediate_size // share.mlp.parts
        bias = 2 * local + hidden if m.mlp_bias else 0
        shares.append(WeightShare("mlp", dense_layers, 3 * local * hidden + bias))
    if placement.moe:
        moe_layers = len(placement.moe.layers)
        local = m.moe_intermediate_size // share.moe.parts
        shared = m.n_shared_experts * m.moe_intermediate_size // share.moe.parts
        shares += [
            WeightShare("router", moe_layers, m.n_routed_experts * hidden, fp32=True),
            WeightShare("experts", moe_layers, m.n_routed_experts * 3 * local * hidden),
        ]
        if shared:
            shares.append(WeightShare("shared_experts", moe_layers, 3 * shared * hidden))
    rows, _ = share.vocab.padded(m.vocab_size)
    shares += [WeightShare("embed_tokens", 1, rows * hidden), WeightShare("norm", 1, hidden)]
    if not m.tie_word_embeddings:
        shares.append(WeightShare("lm_head", 1, rows * hidden))
    return shares


def _attention(placement: DensePlacement, share: RankPlacement) -> list[WeightShare]:
    m = placement.model
    hidden, layers = m.hidden_size, m.num_layers
    q_heads = len(share.q_heads)
    o_bias = hidden if m.o_bias else 0
    if not m.is_mla:
        d = m.head_dim
        kv_heads = placement.layout.kv_heads_per_rank()
        rows = (q_heads + 2 * kv_heads) * d
        o_cols = len(share.o_proj.span(m.num_heads * d))
        return [
            WeightShare("qkv_proj", layers, rows * hidden + (rows if m.qkv_bias else 0)),
            WeightShare("o_proj", layers, hidden * o_cols + o_bias),
        ]
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    if m.q_lora_rank:
        q = m.q_lora_rank * hidden + m.q_lora_rank + q_heads * qk * m.q_lora_rank
        q += m.q_lora_rank if m.qkv_bias else 0
    else:
        q = q_heads * qk * hidden
    out_heads = len(share.o_proj.span(m.num_heads))
    kv_a = latent * hidden + m.kv_lora_rank + (latent if m.qkv_bias else 0)
    kv_b = (q_heads * m.qk_nope_head_dim + out_heads * m.v_head_dim) * m.kv_lora_rank
    return [
        WeightShare("q_proj", layers, q),
        WeightShare("kv_a_proj", layers, kv_a),
        WeightShare("kv_b_proj", layers, kv_b),
        WeightShare("o_proj", layers, hidden * out_heads * m.v_head_dim + o_bias),
    ]


def weight_bytes(placement: DensePlacement, rank: int, dtype_bytes: int) -> int:
    """Bytes of the parameters rank `rank` allocates in a model dtype of `dtype_bytes` per element."""
    return sum(s.bytes(dtype_bytes) for s in weight_shares(placement, rank))
