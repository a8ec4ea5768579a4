"""The paged, DCP-aware attention layer: write this rank's tokens to the cache, attend, return this rank's columns.

The layer returns the columns of the attention output that the plan's placement gives this rank (engine.placement):
its own heads, or with the sharded placement a 1/dcp slice of its DCP group's heads (which may cut through a head).
Prefill chunks attend causally to their own new tokens (all in hand), computing only the heads that overlap the
rank's columns, and, when they have cached context, to that context through the DCP path; the two parts merge by
LSE, column by column. Without DCP a backend may attend to the context and the new tokens in one pass instead
(`prefill_in_context`: the CPU kernels read the context from the paged cache), with no merge. With an fp8 cache the
new tokens attend to their keys and values as the cache stores them
(engine.kv_quant), so a prompt's answer does not depend on whether its prefix came from the cache, a
preemption's recompute or the prompt itself. Decoding tokens are already in the cache (written first) and attend to
it through the DCP path. The layer holds its cache's scales (`k_scale`, `v_scale`; MLA: one for the latent): the
stores divide by them, attention to the cache folds them in (scores by scale x k_scale, the output times v_scale).
With `calibrating` set, the first step with a prefill sets them from its new keys and values (`calibrate`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine import kv_quant
from engine.attention.backend import AttentionMetadata, PagedKV, Rotary, current_metadata
from engine.attention.dcp_combine import CombineSpec, attend_cache, merge_weights
from engine.distributed import all_reduce_max, get_parallel

# vLLM's calibration constants (its K_SCALE_CONSTANT / V_SCALE_CONSTANT defaults): a calibrated scale maps the first
# prefill's largest |key| to 200 and largest |value| to 100, whatever the fp8 format: headroom (x2.24 and x4.48 in
# e4m3) for later tokens larger than any of the first prefill's.
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0


class PagedAttention(nn.Module):
    """Attention of the rank's query heads. q [N, Hq, Dk], k [N, Hkv, Dk], v [N, Hkv, Dv] (MLA: v = k[..., :Dv]);
    returns [N, W], the rank's merged columns. `heads_per_kv`: query heads per KV head in the whole model."""

    def __init__(
        self,
        num_kv_heads: int,
        key_dim: int,
        value_dim: int,
        scale: float,
        heads_per_kv: int,
        value_in_key: bool = False,
    ):
        super().__init__()
        par = get_parallel()
        share = par.placement
        self.num_kv_heads, self.key_dim, self.value_dim = num_kv_heads, key_dim, value_dim
        self.scale = scale
        self.value_in_key = value_in_key
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None  # None for MLA: values live inside the key cache
        self.k_scale, self.v_scale = 1.0, 1.0  # an fp8 cache's scales (float32 values; MLA: v_scale = k_scale)
        self.calibrating = False  # set the scales from the next step with a prefill (cache.calculate_kv_scales)
        self.calibration_group = par.world_group  # every rank of the engine takes the same scales
        self.spec = CombineSpec(par, par.device)
        self.width = share.merge_width
        # prefill of new tokens: only the heads overlapping this rank's columns, then those columns
        heads, columns = share.merge_heads, share.merge_columns
        self.new_heads = slice(heads.start - share.q_heads.start, heads.stop - share.q_heads.start)
        self.new_columns = slice(columns.start - heads.start * value_dim, columns.stop - heads.start * value_dim)
        self.new_kv, self.new_kv_index = _kv_heads_of(heads, heads_per_kv, par.role.kv_head_start, par.device)
        new_head_of_col = torch.arange(columns.start, columns.stop, device=par.device) // value_dim - heads.start
        # a chunk's merge with its cached context: each column takes the weights of its (new-token head, cached-context
        # head) pair, computed once per pair (a few heads) instead of once per column
        pairs, self.pair_of_col = torch.unique(
            torch.stack([new_head_of_col, self.spec.head_of_col.to(par.device)], 1), dim=0, return_inverse=True
        )
        self.pair_new_head, self.pair_cache_head = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
        # without DCP, when the new tokens' heads are the cached context's (no query gather, whole KV groups, separate
        # values), a chunk attends to its context and to itself in one pass where the backend can (no merge)
        self.one_pass_context = (
            self.spec.size == 1
            and not value_in_key
            and self.new_kv_index is None
            and share.attended == share.q_heads
            and torch.equal(self.pair_new_head, self.pair_cache_head)
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of rotated q, k and v (MLA)."""
        md = current_metadata()
        if self.calibrating and md.prefill is not None:
            self.calibrate(k, None if self.value_in_key else v)
        md.backend.write_cache(k, None if self.value_in_key else v, self.key_cache, self.value_cache, md, self.scales)
        return self._attend(q, k, v, md)

    def rotary_forward(self, qkv: torch.Tensor, rope: Rotary, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention of one projection's unrotated heads qkv [N, Hq + 2 Hkv, D]: the backend rotates q and k and
        stores k and v in one call (one op on CPU)."""
        md = current_metadata()
        if self.calibrating and md.prefill is not None:  # the scales first, from the rotated keys: then the store
            qk = rope.apply(qkv[:, : -self.num_kv_heads], cos, sin)
            return self.forward(qk[:, : -self.num_kv_heads], qk[:, -self.num_kv_heads :], qkv[:, -self.num_kv_heads :])
        q, k = md.backend.rotate_and_write(qkv, rope, cos, sin, self.key_cache, self.value_cache, md, self.scales)
        if md.prefill is None:  # v is only read by a prefill: no slice of it at decode
            return self._decode(q, md)
        return self._attend(q, k, qkv[:, q.shape[1] + k.shape[1] :], md)

    @property
    def scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) of this layer's cache."""
        return self.k_scale, self.v_scale

    def calibrate(self, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Set the scales from a prefill's new keys and values (vLLM's `calculate_kv_scales` rule): the largest |key|
        / 200 and the largest |value| / 100 (MLA: one scale, the latent's largest / 200), each the largest over every
        rank (each holds some of the heads: the scales are the whole layer's, the same on every rank and layout). A
        layer whose keys (values) are all zero keeps 1.0."""
        amax = torch.stack([k.abs().amax(), (k if v is None else v).abs().amax()]).float()
        amax = all_reduce_max(amax, self.calibration_group).tolist()
        constants = (K_SCALE_CONSTANT, K_SCALE_CONSTANT if v is None else V_SCALE_CONSTANT)
        scales = [kv_quant.fp32(m / c) if m > 0 else 1.0 for m, c in zip(amax, constants, strict=True)]
        self.k_scale, self.v_scale = scales
        self.calibrating = False

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The rest of the layer once the new keys and values are in the cache."""
        if md.prefill is None:  # a decode-only step: no copy into a joint output
            return self._decode(q, md)
        prefill_tokens = md.num_prefill_tokens
        out = q.new_empty(q.shape[0], self.width)
        out[:prefill_tokens] = self._prefill(q[:prefill_tokens], k[:prefill_tokens], v[:prefill_tokens], md)
        if md.decode is not None:
            out[prefill_tokens:] = self._decode(q[prefill_tokens:], md)
        return out

    def _decode(self, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The decoding rows' attention to the cache (they are written first): this rank's columns [T, W]."""
        return self._attend_cache(q, md, md.decode, False)[0]

    def _attend_cache(
        self, q: torch.Tensor, md: AttentionMetadata, kv: PagedKV, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attend_cache` with the cache's scales folded in: scores of the stored keys times k_scale, the output of the
        stored values times v_scale (exact for 1.0: no op)."""
        scale = self.scale * self.k_scale
        out, lse = attend_cache(md.backend, self.spec, q, self.key_cache, self.value_cache, kv, scale, need_lse)
        return (out if self.v_scale == 1.0 else out * self.v_scale), lse

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        backend = md.backend
        context = md.prefill_context is not None
        if self.new_kv_index is not None:
            k, v = k.index_select(1, self.new_kv_index), v.index_select(1, self.new_kv_index)
        else:
            k, v = k[:, self.new_kv], v[:, self.new_kv]
        if kv_quant.is_fp8(self.key_cache.dtype):  # the new tokens see each other as the cache stores them
            dtype = self.key_cache.dtype
            k, v = kv_quant.as_stored(k, dtype, self.k_scale), kv_quant.as_stored(v, dtype, self.v_scale)
        if context and self.one_pass_context and md.prefill.context_lens is not None:
            caches = self.key_cache[:, :, self.new_kv], self.value_cache[:, :, self.new_kv]
            o = backend.prefill_in_context(q[:, self.new_heads], k, v, md.prefill, *caches, self.scale)
            if o is not None:
                return o.reshape(o.shape[0], -1)[:, self.new_columns]
        o, lse = backend.prefill_new(q[:, self.new_heads], k, v, md.prefill, self.scale, need_lse=context)
        o = o.reshape(o.shape[0], -1)[:, self.new_columns]
        if not context:
            return o
        lo, hi = md.prefill_context_rows  # a step's fresh prompts have no context: no merge for their rows
        oc, lse_c = self._attend_cache(q[lo:hi], md, md.prefill_context, True)
        w_new, w_c = merge_weights(
            lse[lo:hi].index_select(1, self.pair_new_head), lse_c.index_select(1, self.pair_cache_head)
        )
        w_new, w_c = w_new.index_select(1, self.pair_of_col), w_c.index_select(1, self.pair_of_col)
        merged = (o[lo:hi].float() * w_new + oc.float() * w_c).to(o.dtype)
        if hi - lo == o.shape[0]:
            return merged
        o[lo:hi] = merged  # o is this layer's own output of prefill_new
        return o


def _kv_heads_of(
    heads: range, heads_per_kv: int, kv_start: int, device: torch.device
) -> tuple[slice, torch.Tensor | None]:
    """The local KV heads the query heads `heads` read: a slice when the heads cover whole KV groups (or share one
    KV head), else (a GQA slice cutting a group) an index with one KV head per query head."""
    first, last = heads.start // heads_per_kv, (heads.stop - 1) // heads_per_kv
    whole = heads.start % heads_per_kv == 0 and heads.stop % heads_per_kv == 0
    if whole or first == last:
        return slice(first - kv_start, last + 1 - kv_start), None
    index = torch.tensor([h // heads_per_kv - kv_start for h in heads], device=device)
    return slice(None), index
