"""The PyTorch reference backend: paged gather and exact softmax with fp32 accumulation (CPU and CUDA).

Its KV cache is head-major in memory ([blocks, kv heads, block_size, dim], exposed to the layers as the
usual [blocks, block_size, kv heads, dim] view), so gathering a sequence's blocks per KV head yields
contiguous [kv heads, tokens, dim] keys: the layout CPU matmuls and the CPU flash kernel read fastest.
The query heads that share a KV head are folded into the query rows, so KV is never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kv_quant
from engine.attention.backend import AttentionBackend, AttentionMetadata, PagedKV, PrefillNew
from engine.attention.kv_layout import HEAD_MAJOR_BACKENDS

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
    folded = q.reshape(s_, tq, hkv, h // hkv, dk).permute(0, 2, 1, 3, 4).reshape(s_, hkv, -1, dk)
    if mask is not None:
        mask = mask.repeat_interleave(h // hkv, dim=1).unsqueeze(1)  # rows follow the folded (Tq, g) order
    out, lse = attend_heads(folded, k.transpose(1, 2), v.transpose(1, 2), scale, mask)
    out = out.reshape(s_, hkv, tq, h // hkv, -1).permute(0, 2, 1, 3, 4).reshape(s_, tq, h, -1)
    return out, lse.reshape(s_, hkv, tq, h // hkv).permute(0, 2, 1, 3).reshape(s_, tq, h)


def attend_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention per KV head: q [S, Hkv, M, Dk], k [S, Hkv, L, Dk], v [S, Hkv, L, Dv], mask broadcastable
    to [S, Hkv, M, L] (True = attend) or None. Returns out [S, Hkv, M, Dv] (fp32) and lse [S, Hkv, M]."""
    if mask is None and q.device.type == "cpu":
        value_dim = v.shape[-1]
        if value_dim < k.shape[-1]:  # the kernel wants one head size (MLA: latent < latent + rope)
            v = F.pad(v, (0, k.shape[-1] - value_dim))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[:2]
        return out[..., :value_dim].float(), lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(probs, v.float()), lse


def _causal_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention (fp32 accumulation) returning the log-sum-exp. q/k [T, H, Dk], v [T, H, Dv]."""
    value_dim = v.shape[-1]
    if value_dim < k.shape[-1]:
        v = F.pad(v, (0, k.shape[-1] - value_dim))
    # GQA: the kernel maps each query head to its key/value head itself (the same bits as repeated keys, no copy)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        0.0,
        True,
        scale=scale,
    )[:2]
    return out[0, ..., :value_dim].transpose(0, 1), lse[0].transpose(0, 1).float()


def _physical(cache: torch.Tensor) -> torch.Tensor:
    """The head-major storage [blocks, H, B, D] behind a layer's [blocks, B, H, D] cache view: each block contiguous,
    blocks any whole number of head blocks [B, D] apart (the cache is block-major across layers)."""
    phys = cache.permute(0, 2, 1, 3)
    block_size, dim = phys.shape[2:]
    packed = all(
        n == 1 or s == want
        for n, s, want in zip(phys.shape[1:], phys.stride()[1:], (block_size * dim, dim, 1), strict=True)
    )
    if not packed or phys.stride(0) % (block_size * dim):
        raise ValueError("the torch backend needs a head-major KV cache (engine.attention.kv_cache.allocate)")
    return phys


def _head_blocks(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A layer's cache as rows of one head's block [B, D] (a view, no copy): row `block * stride + head`; and that
    stride. The rows between one block's heads and the next block's belong to other layers and are never indexed."""
    phys = _physical(cache)
    blocks, heads, block_size, dim = phys.shape
    stride = phys.stride(0) // (block_size * dim)
    rows = phys.as_strided(((blocks - 1) * stride + heads, block_size, dim), (block_size * dim, dim, 1))
    return rows, stride


class TorchBackend(AttentionBackend):
    name = "torch"
    head_major_cache = name in HEAD_MAJOR_BACKENDS

    def prepare(self, metadata: AttentionMetadata) -> None:
        slots = metadata.slot_mapping
        owned = (slots >= 0).nonzero().squeeze(1)
        mine = slots if owned.numel() == slots.numel() else slots[owned]
        metadata.extra["write_rows"] = None if owned.numel() == slots.numel() else owned
        for kv in (metadata.prefill_context, metadata.decode):
            if kv is not None:
                blocks = max(1, -(-kv.max_len // kv.block_size))
                kv.extra["tables"] = kv.block_tables[:, :blocks]
                kv.extra["valid"] = torch.arange(blocks * kv.block_size, device=kv.lens.device) < kv.lens.unsqueeze(1)
                kv.extra.pop("head_rows", None)  # the gather index of these tables: built by the first layer
        metadata.extra["write_slots"] = mine

    def write_cache(self, key, value, key_cache, value_cache, metadata, scales=(1.0, 1.0)) -> None:
        rows, slots = metadata.extra["write_rows"], metadata.extra["write_slots"]
        if slots.numel() == 0:
            return
        block_size = key_cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        for new, cache, scale in ((key, key_cache, scales[0]), (value, value_cache, scales[1])):
            if cache is not None:
                mine = new if rows is None else new.index_select(0, rows)
                _physical(cache)[blocks, :, offsets] = kv_quant.to_cache(mine, cache.dtype, scale)  # may be narrower

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
                o, l_ = (t[0] for t in softmax_attention(qs[None], ks[None], vs[None], scale, causal[None]))
            out[start : start + n] = o
            lse[start : start + n] = l_
            start += n
        return out, lse if need_lse else None

    def paged(self, q, key_cache, value_cache, value_dim, kv: PagedKV, scale):
        tables, valid = kv.extra["tables"], kv.extra["valid"]
        seqs, heads = tables.shape[0], key_cache.shape[2]
        rows, stride = _head_blocks(key_cache)
        cached = kv.extra.get("head_rows")  # the same for every layer of one cache: computed by the first
        if cached is not None and cached[0] == stride:
            index = cached[1]
        else:
            first = tables.unsqueeze(1) * stride
            index = (first + torch.arange(heads, device=tables.device).view(1, -1, 1)).reshape(-1)
            kv.extra["head_rows"] = (stride, index)

        def gather(cache: torch.Tensor) -> torch.Tensor:  # [S, Hkv, tokens, D], contiguous
            flat, own = (rows, stride) if cache is key_cache else _head_blocks(cache)
            if own != stride:
                raise ValueError("the key and value caches must share one layout (engine.attention.kv_cache.allocate)")
            return flat.index_select(0, index).view(seqs, heads, -1, cache.shape[3])

        keys = gather(key_cache).to(q.dtype)  # a narrower cache (cache.dtype) is read in the model's dtype
        values = keys[..., :value_dim] if value_cache is None else gather(value_cache).to(q.dtype)
        group = q.shape[1] // heads
        if kv.one_query_each:
            folded = q.view(seqs, heads, group, -1)
            mask = valid[:, None, None, :]
            if not kv.need_lse:  # one fused kernel when only the output is wanted
                out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
                return out.reshape(seqs, heads * group, -1), None
            out, lse = attend_heads(folded, keys, values, scale, mask)
            return out.reshape(seqs, heads * group, -1).to(q.dtype), lse.reshape(seqs, heads * group)
        out = torch.zeros(q.shape[0], q.shape[1], value_dim, dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[0], q.shape[1]), NEG_INF, dtype=torch.float32, device=q.device)
        start = 0
        for s, (n, length) in enumerate(zip(kv.query_counts, kv.local_lens, strict=True)):
            if length:  # a rank holding none of this sequence's context contributes 0 / -inf
                rows = (
                    q[start : start + n]
                    .reshape(n, heads, group, -1)
                    .permute(1, 0, 2, 3)
                    .reshape(1, heads, n * group, -1)
                )
                o, l_ = attend_heads(rows, keys[s : s + 1, :, :length], values[s : s + 1, :, :length], scale, None)
                o = o[0].reshape(heads, n, group, -1).permute(1, 0, 2, 3)
                out[start : start + n] = o.reshape(n, heads * group, -1)
                lse[start : start + n] = l_[0].reshape(heads, n, group).permute(1, 0, 2).reshape(n, heads * group)
            start += n
        return out, lse
