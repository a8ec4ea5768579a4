"""Triton kernels for paged, DCP-sharded attention, and the thin launchers that call them.

- `store_kv`: write each token's key (and value) at its cache slot; slot -1 (another rank's token) is skipped.
- `paged_attention`: split-KV ("flash-decoding") attention of query rows to their sequence's local cache shard,
  through the block table, unmasked; all query heads of one KV head are handled by one program (GQA / MLA).
  Several query rows per sequence (cached context of a prefill chunk) use the same kernel.
- `prefill_attention`: variable-length causal attention among the new tokens of each chunk (cu_seqlens).
- `merge_partials`: the softmax-exact merge of partial attentions by log-sum-exp (the split-KV reduction).

All return the log-sum-exp (natural log, fp32; -inf where a row saw no key) and accumulate in fp32.

CUDA tensors run compiled kernels; CPU tensors run the same kernel bodies in the Triton interpreter (tests, CPU
plans): engine.kernels.triton_modes says how, and what that asks of a kernel body.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

from engine.kernels.triton_modes import interpreted, jit_bodies, next_pow2

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------------
# Kernel bodies, jitted per mode by `_kernels`. Self-contained: no jitted helpers of their own or of triton's.
# ----------------------------------------------------------------------------------------------------------------


def _store_kv_kernel(
    KEY, VAL, KCACHE, VCACHE, SLOTS,
    num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HKV: tl.constexpr,
    HAS_VALUE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(SLOTS + t, mask=t < num_tokens, other=-1).to(tl.int64)
    keep = slot >= 0
    blk = tl.where(keep, slot // BLOCK_SIZE, 0)
    off = tl.where(keep, slot % BLOCK_SIZE, 0)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    t64 = t.to(tl.int64)

    h = e // DK
    d = e % DK
    mask = keep[:, None] & (e < HKV * DK)[None, :]
    src = KEY + t64[:, None] * stride_kt + h[None, :] * stride_kh + d[None, :] * stride_kd
    dst = KCACHE + blk[:, None] * stride_kcb + off[:, None] * stride_kcs + h[None, :] * stride_kch
    dst += d[None, :] * stride_kcd
    tl.store(dst, tl.load(src, mask=mask).to(KCACHE.dtype.element_ty), mask=mask)
    if HAS_VALUE:
        h = e // DV
        d = e % DV
        mask = keep[:, None] & (e < HKV * DV)[None, :]
        src = VAL + t64[:, None] * stride_vt + h[None, :] * stride_vh + d[None, :] * stride_vd
        dst = VCACHE + blk[:, None] * stride_vcb + off[:, None] * stride_vcs + h[None, :] * stride_vch
        dst += d[None, :] * stride_vcd
        tl.store(dst, tl.load(src, mask=mask).to(VCACHE.dtype.element_ty), mask=mask)


def _paged_attention_kernel(
    Q, KCACHE, VCACHE, TABLES, LENS, QSTART, OUT, LSE,
    scale_log2, split_len, num_kv_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tab,
    stride_op, stride_ot, stride_oh, stride_od,
    stride_lp, stride_lt, stride_lh,
    G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    VALUE_IN_KEY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (sequence, tile of (query row, head-in-group) pairs, kv head x split)
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2) % num_kv_heads
    split = tl.program_id(2) // num_kv_heads
    q_first = tl.load(QSTART + seq)
    num_rows = (tl.load(QSTART + seq + 1) - q_first) * G
    if tile * BLOCK_M >= num_rows:
        return
    length = tl.load(LENS + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < num_rows
    token = q_first + r // G
    head = kv_head * G + r % G
    q_row = Q + token.to(tl.int64) * stride_qt + head * stride_qh
    da = tl.arange(0, DA)
    qa = tl.load(q_row[:, None] + da[None, :] * stride_qd, mask=row_ok[:, None] & (da < DK)[None, :], other=0.0)
    if DOT_F32:
        qa = qa.to(tl.float32)
    if DB > 0:
        db = DA + tl.arange(0, DB)
        qb = tl.load(q_row[:, None] + db[None, :] * stride_qd, mask=row_ok[:, None] & (db < DK)[None, :], other=0.0)
        if DOT_F32:
            qb = qb.to(tl.float32)
    dv = tl.arange(0, BLOCK_DV)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    table = TABLES + seq.to(tl.int64) * stride_tab
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        blk = tl.load(table + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        k_row = KCACHE + blk * stride_kb + (j % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        ka = tl.load(k_row[:, None] + da[None, :] * stride_kd, mask=j_ok[:, None] & (da < DK)[None, :], other=0.0)
        if DOT_F32:
            ka = ka.to(tl.float32)
        qk = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
        if DB > 0:
            kb = tl.load(k_row[:, None] + db[None, :] * stride_kd, mask=j_ok[:, None] & (db < DK)[None, :], other=0.0)
            if DOT_F32:
                kb = kb.to(tl.float32)
            qk += tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
        qk = tl.where(j_ok[None, :], qk * scale_log2, float("-inf"))
        # every iteration has a valid key, so m_new is finite and exp2(m_i - m_new) never sees -inf - -inf
        m_new = tl.maximum(m_i, tl.reduce(qk, 1, _elementwise_max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        if VALUE_IN_KEY:
            v = ka  # MLA: the values are the first DV <= DA dims of the latent key, already loaded
        else:
            v_row = VCACHE + blk * stride_vb + (j % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
            v = tl.load(v_row[:, None] + dv[None, :] * stride_vd, mask=j_ok[:, None] & (dv < DV)[None, :], other=0.0)
            if DOT_F32:
                v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    t64 = token.to(tl.int64)
    o_ptr = OUT + split.to(tl.int64) * stride_op + t64[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptr + dv[None, :] * stride_od, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])
    tl.store(LSE + split.to(tl.int64) * stride_lp + t64 * stride_lt + head * stride_lh, lse, mask=row_ok)


def _prefill_attention_kernel(
    Q, K, V, CU, OUT, LSE,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    G: tl.constexpr, DK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (chunk, tile of query tokens, query head); causal among the chunk's own tokens
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // G
    first = tl.load(CU + seq).to(tl.int64)
    n = tl.load(CU + seq + 1).to(tl.int64) - first
    if tile * BLOCK_M >= n:
        return
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < n
    q_row = Q + (first + r) * stride_qt + head * stride_qh
    da = tl.arange(0, DA)
    qa = tl.load(q_row[:, None] + da[None, :] * stride_qd, mask=row_ok[:, None] & (da < DK)[None, :], other=0.0)
    if DOT_F32:
        qa = qa.to(tl.float32)
    if DB > 0:
        db = DA + tl.arange(0, DB)
        qb = tl.load(q_row[:, None] + db[None, :] * stride_qd, mask=row_ok[:, None] & (db < DK)[None, :], other=0.0)
        if DOT_F32:
            qb = qb.to(tl.float32)
    dv = tl.arange(0, BLOCK_DV)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    hi = tl.minimum((tile + 1) * BLOCK_M, n)
    for n0 in range(0, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < n
        k_row = K + (first + j) * stride_kt + kv_head * stride_kh
        ka = tl.load(k_row[:, None] + da[None, :] * stride_kd, mask=j_ok[:, None] & (da < DK)[None, :], other=0.0)
        if DOT_F32:
            ka = ka.to(tl.float32)
        qk = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
        if DB > 0:
            kb = tl.load(k_row[:, None] + db[None, :] * stride_kd, mask=j_ok[:, None] & (db < DK)[None, :], other=0.0)
            if DOT_F32:
                kb = kb.to(tl.float32)
            qk += tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
        # key 0 is visible to every row (padding rows too), so the running max is finite from the first block
        visible = j_ok[None, :] & (j[None, :] <= r[:, None])
        qk = tl.where(visible, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(qk, 1, _elementwise_max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        v_row = V + (first + j) * stride_vt + kv_head * stride_vh
        v = tl.load(v_row[:, None] + dv[None, :] * stride_vd, mask=j_ok[:, None] & (dv < DV)[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    t64 = first + r
    o_ptr = OUT + t64[:, None] * stride_ot + head * stride_oh + dv[None, :] * stride_od
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])
    tl.store(LSE + t64 * stride_lt + head * stride_lh, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


def _merge_kernel(
    PART_O, PART_L, OUT, LSE,
    num_parts, num_heads,
    stride_pp, stride_pt, stride_ph, stride_pd,
    stride_lp, stride_lt, stride_lh,
    stride_ot, stride_oh, stride_od,
    stride_rt, stride_rh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # program (row, head): online merge over the parts; parts with lse -inf weigh exactly 0
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dv = tl.arange(0, BLOCK_DV)
    m = tl.load(PART_L + t * stride_lt + h * stride_lh)
    total = tl.where(m == float("-inf"), 0.0, 1.0)
    acc = total * tl.load(PART_O + t * stride_pt + h * stride_ph + dv * stride_pd, mask=dv < DV, other=0.0).to(
        tl.float32
    )
    for p in range(1, num_parts):
        lse_p = tl.load(PART_L + p * stride_lp + t * stride_lt + h * stride_lh)
        o_p = tl.load(PART_O + p * stride_pp + t * stride_pt + h * stride_ph + dv * stride_pd, mask=dv < DV, other=0.0)
        m_new = tl.maximum(m, lse_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_p - m_safe)
        total = total * alpha + w
        acc = acc * alpha + w * o_p.to(tl.float32)
        m = m_new
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    tl.store(OUT + t * stride_ot + h * stride_oh + dv * stride_od, out.to(OUT.dtype.element_ty), mask=dv < DV)
    tl.store(LSE + t * stride_rt + h * stride_rh, lse)


_BODIES = {
    "store_kv": _store_kv_kernel,
    "paged": _paged_attention_kernel,
    "prefill": _prefill_attention_kernel,
    "merge": _merge_kernel,
}


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The kernels jitted for the compiler (False) or the interpreter (True), made once per mode."""
    return jit_bodies(_BODIES, interpret)


def _key_split(dk: int) -> tuple[int, int]:
    """Key dims as a power-of-two part DA plus a padded rest DB (0: none), e.g. 576 = 512 + 64, 40 = 32 + 16."""
    da = max(16, 1 << (dk.bit_length() - 1))
    rest = dk - da
    return da, (max(16, next_pow2(rest)) if rest > 0 else 0)


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs must not be rounded to tf32: the fp32 engine is checked against an fp32 oracle
    return "ieee" if dtype == torch.float32 else None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    slots: torch.Tensor,
) -> None:
    """Write key [N, Hkv, Dk] (and value [N, Hkv, Dv]) into caches [blocks, B, Hkv, D] at `slots`; -1 is skipped."""
    n = key.shape[0]
    if n == 0:
        return
    hkv, dk = key.shape[1], key.shape[2]
    has_value = value is not None and value_cache is not None
    dv = value.shape[2] if has_value else dk
    width = hkv * max(dk, dv)
    interp = interpreted(key)
    block_t = 64 if interp else 16
    block_e = min(next_pow2(width), 4096 if interp else 1024)
    v, vc = (value, value_cache) if has_value else (key, key_cache)
    grid = (triton.cdiv(n, block_t), triton.cdiv(width, block_e))
    _kernels(interp).store_kv[grid](
        key, v, key_cache, vc, slots, n,
        *key.stride(), *v.stride(), *key_cache.stride(), *vc.stride(),
        BLOCK_SIZE=key_cache.shape[1], DK=dk, DV=dv, HKV=hkv, HAS_VALUE=has_value,
        BLOCK_T=block_t, BLOCK_E=block_e,
    )  # fmt: skip


@dataclass(frozen=True)
class PagedConfig:
    """Tiling of the paged kernel: query rows per program, keys per iteration, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        # tl.dot compiles for a GPU only with M, N, K >= 16 (the Triton interpreter accepts less)
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"PagedConfig tiles must be at least 16 (got block_m={self.block_m}, "
                             f"block_n={self.block_n}): tl.dot needs it on a GPU")  # fmt: skip


def default_paged_config(key_dim: int, queries_per_seq: int, group: int, interpret: bool) -> PagedConfig:
    """Tiling by shape: decode rows are few (one token x the group), context rows many; MLA keys are wide."""
    if interpret:
        return PagedConfig(block_m=16, block_n=64)
    rows = queries_per_seq * group
    block_m = 16 if rows <= 16 else (32 if rows <= 32 or key_dim > 256 else 64)
    if key_dim > 256:
        return PagedConfig(block_m=block_m, block_n=32, num_warps=8, num_stages=2)
    return PagedConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=3 if rows <= 16 else 2)


def choose_splits(max_len: int, programs: int, block_n: int, device: torch.device, interpret: bool) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the GPU, at least 256 keys per split."""
    if interpret or max_len <= 0:
        return 1, max(max_len, 1)
    target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    splits = max(1, min(triton.cdiv(target, max(programs, 1)), triton.cdiv(max_len, 256), 256))
    split_len = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n
    return triton.cdiv(max_len, split_len), split_len


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    value_dim: int,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    query_start: torch.Tensor,
    max_queries: int,
    max_len: int,
    scale: float,
    num_splits: int | None = None,
    config: PagedConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row of sequence s (rows query_start[s]..query_start[s+1]-1) attends, unmasked, to the first
    lens[s] tokens of its cache shard (local index j at block_tables[s, j // B] * B + j % B).

    q [T, H, Dk]; key_cache [blocks, B, Hkv, Dk]; value_cache like it with Dv, or None (MLA: values are the
    first `value_dim` key dims). Returns out [T, H, Dv] in q's dtype and lse [T, H] fp32 (rows without keys:
    0 and -inf). `max_queries` bounds the rows per sequence and `max_len` the lens (host ints, no sync).
    Rows must be exactly the sequences' rows (query_start[-1] == T). `num_splits` forces the split-KV count
    (tests, benchmarks); None picks it from the shapes (always 1 in the interpreter).
    """
    tokens, heads, dk = q.shape
    hkv = key_cache.shape[2]
    group = heads // hkv
    seqs = lens.shape[0]
    if tokens == 0 or seqs == 0 or max_len <= 0:
        out = torch.zeros(tokens, heads, value_dim, dtype=q.dtype, device=q.device)
        return out, torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q.device)
    # every row belongs to one sequence, so the kernel writes all of out / lse (rows without keys: 0, -inf)
    out = torch.empty(tokens, heads, value_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    interp = interpreted(q)
    cfg = config or default_paged_config(dk, max_queries, group, interp)
    da, db = _key_split(dk)
    # MLA: reuse the loaded key tile as the values when they fit in its power-of-two part, else load them
    # from the key cache like a value cache
    value_in_key = value_cache is None and value_dim <= da
    block_dv = da if value_in_key else max(16, next_pow2(value_dim))
    tiles = triton.cdiv(max_queries * group, cfg.block_m)
    if num_splits is None:
        splits, split_len = choose_splits(max_len, seqs * tiles * hkv, cfg.block_n, q.device, interp)
    else:
        split_len = triton.cdiv(triton.cdiv(max_len, num_splits), cfg.block_n) * cfg.block_n
        splits = triton.cdiv(max_len, split_len)
    if splits == 1:
        part_o, part_l = out, lse.unsqueeze(0)
        part_o_strides = (0, *out.stride())
    else:
        part_o = torch.empty(splits, tokens, heads, value_dim, dtype=torch.float32, device=q.device)
        part_l = torch.empty(splits, tokens, heads, dtype=torch.float32, device=q.device)
        part_o_strides = part_o.stride()
    vc = key_cache if value_cache is None else value_cache
    # a cache dtype other than the queries' (cache.dtype) cannot meet them in one tensor-core dot: use fp32 dots
    dot_f32 = interp or q.dtype != key_cache.dtype
    precision = "ieee" if dot_f32 or torch.float32 in (q.dtype, key_cache.dtype) else None
    extra = {} if interp else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    grid = (seqs, tiles, hkv * splits)
    _kernels(interp).paged[grid](
        q, key_cache, vc, block_tables, lens, query_start, part_o, part_l,
        scale * LOG2E, split_len, hkv,
        *q.stride(), *key_cache.stride(), *vc.stride(), block_tables.stride(0),
        *part_o_strides, *part_l.stride(),
        G=group, BLOCK_SIZE=key_cache.shape[1], DK=dk, DA=da, DB=db, DV=value_dim, BLOCK_DV=block_dv,
        VALUE_IN_KEY=value_in_key, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_F32=dot_f32, PRECISION=precision, **extra,
    )  # fmt: skip
    if splits > 1:
        # every row belongs to a sequence, so every (split, row) was written (splits past a sequence's end: 0, -inf)
        _merge_into(part_o, part_l, out, lse)
    return out, lse


def _merge_into(part_o: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    parts, tokens, heads, dv = part_o.shape
    _kernels(interpreted(out)).merge[(tokens, heads)](
        part_o, part_l, out, lse, parts, heads,
        *part_o.stride(), *part_l.stride(), *out.stride(), *lse.stride(),
        DV=dv, BLOCK_DV=max(16, next_pow2(dv)),
    )  # fmt: skip


def merge_partials(part_o: torch.Tensor, part_l: torch.Tensor, out_dtype: torch.dtype | None = None):
    """Merge P partial attentions over disjoint key sets: part_o [P, T, H, Dv], part_l [P, T, H] ->
    (out [T, H, Dv], lse [T, H]). A part with lse -inf contributes exactly 0; a row empty everywhere gives 0, -inf."""
    _, tokens, heads, dv = part_o.shape
    out = torch.empty(tokens, heads, dv, dtype=out_dtype or part_o.dtype, device=part_o.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=part_o.device)
    if tokens and heads:
        _merge_into(part_o, part_l, out, lse)
    return out, lse


def default_prefill_blocks(key_dim: int, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of the prefill kernel."""
    if interpret:
        return 32, 32, 4, 1
    if key_dim > 256:
        return 32, 32, 8, 2
    return 64, 64, 4, 2


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each chunk's tokens (rows cu_seqlens[i]..cu_seqlens[i+1]-1) to the chunk's earlier
    tokens. q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] -> out [T, H, Dv] in q's dtype, lse [T, H] fp32."""
    tokens, heads, dk = q.shape
    dv = v.shape[2]
    out = torch.empty(tokens, heads, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    chunks = cu_seqlens.shape[0] - 1
    if tokens == 0 or chunks <= 0:
        return out, lse
    interp = interpreted(q)
    block_m, block_n, warps, stages = default_prefill_blocks(dk, interp)
    da, db = _key_split(dk)
    extra = {} if interp else {"num_warps": warps, "num_stages": stages}
    grid = (chunks, triton.cdiv(max_len, block_m), heads)
    _kernels(interp).prefill[grid](
        q, k, v, cu_seqlens, out, lse, scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        G=heads // k.shape[1], DK=dk, DA=da, DB=db, DV=dv, BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=interp, PRECISION=_precision(q.dtype), **extra,
    )  # fmt: skip
    return out, lse
