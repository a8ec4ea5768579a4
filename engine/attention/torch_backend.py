"""The PyTorch reference backend: paged gather and exact softmax with fp32 accumulation (CPU and CUDA)."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, PagedKV, PrefillNew

NEG_INF = float("-inf")


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in fp32 with a leading batch dim.

    q [S, Tq, H, Dk], k [S, L, Hkv, Dk], v [S, L, Hkv, Dv], mask [S, Tq, L] (True = attend) or None.
    Returns out [S, Tq, H, Dv] (fp32) and lse [S, Tq, H]; a row that attends to nothing gives 0 and -inf.
    """
    s_, tq, h, dk = q.shape
    hkv = k.shape[2]
    group = h // hkv
    qf = q.float().reshape(s_, tq, hkv, group, dk).permute(0, 2, 3, 1, 4)  # [S, Hkv, g, Tq, Dk]
    kf = k.float().permute(0, 2, 3, 1).unsqueeze(2)  # [S, Hkv, 1, Dk, L]
    scores = torch.matmul(qf, kf) * scale  # [S, Hkv, g, Tq, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [S, Hkv, g, Tq]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(probs, v.float().permute(0, 2, 1, 3).unsqueeze(2))  # [S, Hkv, g, Tq, Dv]
    out = out.permute(0, 3, 1, 2, 4).reshape(s_, tq, h, -1)
    return out, lse.permute(0, 3, 1, 2).reshape(s_, tq, h)


def _causal_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention (fp32 accumulation) that also returns the log-sum-exp. q/k [T, H, Dk], v [T, H, Dv]."""
    value_dim = v.shape[-1]
    if value_dim < k.shape[-1]:  # the kernel wants one head size: pad values (MLA: latent < latent + rope)
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - value_dim))
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        0.0,
        True,
        scale=scale,
    )[:2]
    return out[0, ..., :value_dim].transpose(0, 1), lse[0].transpose(0, 1).float()


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `slots` [S, L] of a paged cache [blocks, block_size, H, D] as [S, L, H, D] (index_select: ~4x faster
    than advanced indexing on CPU)."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[2:])


class TorchBackend(AttentionBackend):
    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> None:
        slots = metadata.slot_mapping
        owned = (slots >= 0).nonzero().squeeze(1)
        metadata.extra["write_rows"] = None if owned.numel() == slots.numel() else owned
        metadata.extra["write_slots"] = slots if owned.numel() == slots.numel() else slots[owned]
        for kv in (metadata.prefill_context, metadata.decode):
            if kv is not None:
                j = torch.arange(max(kv.max_len, 1), device=kv.lens.device)
                slot = (
                    kv.block_tables.gather(1, (j // kv.block_size).expand(kv.lens.numel(), -1)) * kv.block_size
                    + j % kv.block_size
                )
                valid = j < kv.lens.unsqueeze(1)
                kv.extra["slots"] = torch.where(valid, slot, 0)
                kv.extra["valid"] = valid

    def write_cache(self, key, value, key_cache, value_cache, metadata) -> None:
        rows, slots = metadata.extra["write_rows"], metadata.extra["write_slots"]
        if slots.numel() == 0:
            return
        for new, cache in ((key, key_cache), (value, value_cache)):
            if cache is None:
                continue
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, slots, new if rows is None else new.index_select(0, rows))

    def prefill_new(self, q, k, v, prefill: PrefillNew, scale, need_lse):
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        start = 0
        for n in prefill.seq_lens:
            qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
            if q.device.type == "cpu":
                o, l_ = _causal_cpu(qs, ks, vs, scale)
            else:
                causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
                o, l_ = softmax_attention(qs[None], ks[None], vs[None], scale, causal[None])
                o, l_ = o[0], l_[0]
            out[start : start + n] = o
            lse[start : start + n] = l_
            start += n
        return out, lse if need_lse else None

    def paged(self, q, key_cache, value_cache, value_dim, kv: PagedKV, scale):
        slots, valid = kv.extra["slots"], kv.extra["valid"]
        keys = _gather(key_cache, slots)  # [S, L, Hkv, Dk]
        values = keys[..., :value_dim] if value_cache is None else _gather(value_cache, slots)
        if kv.one_query_each and not kv.need_lse:  # one fused kernel when only the output is wanted
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=valid[:, None, None, :],
                scale=scale,
                enable_gqa=True,
            )
            return out[:, :, 0], None
        if kv.one_query_each:
            out, lse = softmax_attention(q.unsqueeze(1), keys, values, scale, valid.unsqueeze(1))
            return out[:, 0].to(q.dtype), lse[:, 0]
        out = torch.empty(q.shape[0], q.shape[1], value_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        start = 0
        for s, n in enumerate(kv.query_counts):
            o, l_ = softmax_attention(
                q[None, start : start + n],
                keys[s : s + 1],
                values[s : s + 1],
                scale,
                valid[s : s + 1, None, :].expand(1, n, -1),
            )
            out[start : start + n], lse[start : start + n] = o[0], l_[0]
            start += n
        return out, lse
