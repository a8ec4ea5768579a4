"""The Triton backend through `create_backend`: per-rank results equal the torch backend's on metadata built by
the model runner, the DCP merge of the ranks equals unsharded attention, and (multiproc) a tiny model at tp2 dcp2
gives the torch backend's greedy tokens. CPU runs the kernels in the Triton interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine import dcp
from engine.attention import kv_cache
from engine.attention import triton_kernels as tk
from engine.attention.registry import create_backend
from engine.attention.torch_backend import softmax_attention
from engine.errors import UserError
from engine.runtime.model_runner import CacheLayout, ModelRunner
from engine.runtime.step import ScheduledChunk, ScheduledStep
from tests.oracle import LOGPROB_TOL, hf_greedy, prompt_ids, read_jsonl, write_plan


def runner_metadata(backend, plan: ScheduledStep, layout: CacheLayout, dcp_size: int, dcp_rank: int, device="cpu"):
    """The step's metadata exactly as ModelRunner.execute builds it (ModelRunner.prepare_inputs itself)."""
    runner = SimpleNamespace(
        cache_layout=layout,
        par=SimpleNamespace(dcp_size=dcp_size, dcp_rank=dcp_rank),
        backend=backend,
        device=torch.device(device),
    )
    runner._metadata = lambda *args: ModelRunner._metadata(runner, *args)
    runner._paged_kv = lambda *args, **kw: ModelRunner._paged_kv(runner, *args, **kw)
    metadata = ModelRunner.prepare_inputs(runner, plan)[2]
    if metadata.decode is not None:
        metadata.decode.need_lse = True  # these checks merge decode partials by LSE even at dcp 1
    return metadata


def make_step(block_size: int, dcp_size: int) -> ScheduledStep:
    """Three prefill chunks (the middle one with cached context) and three decodes; distinct block ids per sequence."""
    span = block_size * dcp_size
    shape = [(0, 5), (9, 6), (0, 3), (0, 1), (2, 1), (20, 1)]  # (start, new tokens)
    chunks, next_block = [], 0
    for i, (start, n) in enumerate(shape):
        blocks = -(-(start + n) // span)
        table = list(range(next_block + 1, next_block + 1 + blocks))[::-1]  # reversed: not the identity map
        next_block += blocks
        chunks.append(ScheduledChunk(seq_id=i, token_ids=[0] * n, start=start, block_table=table, sample=True))
    return ScheduledStep(chunks=chunks)


class World:
    """Random global K/V/Q of every sequence position (the same on every rank), like one attention layer sees."""

    def __init__(self, plan: ScheduledStep, heads, hkv, dk, dv, mla, device="cpu", dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.plan, self.heads, self.hkv, self.dk, self.dv, self.mla = plan, heads, hkv, dk, dv, mla
        self.device, self.dtype = device, dtype
        self.keys, self.values, self.queries = [], [], []

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        for ch in plan.chunks:
            total = ch.start + len(ch.token_ids)
            k = rand(total, hkv, dk)
            self.keys.append(k)
            self.values.append(k[..., :dv] if mla else rand(total, hkv, dv))
            self.queries.append(rand(len(ch.token_ids), heads, dk))

    def new_tokens(self):
        """This step's rows: keys, values and queries of every chunk's new tokens, concatenated."""
        ks = [k[ch.start :] for k, ch in zip(self.keys, self.plan.chunks, strict=True)]
        vs = [v[ch.start :] for v, ch in zip(self.values, self.plan.chunks, strict=True)]
        return torch.cat(ks), torch.cat(vs), torch.cat(self.queries)

    def caches(self, layout: CacheLayout, rank: int, dcp_size: int, backend):
        """This rank's cache holding every sequence's context (positions before the chunk), as earlier steps left it,
        allocated in `backend`'s layout: the middle layer of three, so kernels see the block-major block stride and a
        view that starts inside the storage."""
        _, (_, (kc, vc), _) = kv_cache.allocate(
            3,
            layout.num_blocks,
            layout.block_size,
            self.hkv,
            self.dk,
            self.mla,
            self.dtype,
            torch.device(self.device),
            backend.head_major_cache,
        )
        for ch, k, v in zip(self.plan.chunks, self.keys, self.values, strict=True):
            pos = torch.arange(ch.start, device=self.device)
            table = torch.tensor(ch.block_table, device=self.device)
            slot = dcp.slot(pos, rank, table, layout.block_size, layout.interleave, dcp_size)
            owned = slot[slot >= 0]
            kc[owned // layout.block_size, owned % layout.block_size] = k[: ch.start][slot >= 0].to(kc.dtype)
            if vc is not None:
                vc[owned // layout.block_size, owned % layout.block_size] = v[: ch.start][slot >= 0].to(vc.dtype)
        return kc, vc


def run_layer(backend, md, world: World, kc, vc, scale):
    """What PagedAttention does with a backend, without the DCP collectives: per-rank partials and their lse."""
    k, v, q = world.new_tokens()
    backend.write_cache(k, None if world.mla else v, kc, vc, md)
    p = md.num_prefill_tokens
    new = backend.prefill_new(q[:p], k[:p], v[:p], md.prefill, scale, need_lse=True)
    lo, hi = md.prefill_context_rows  # the rows of the chunks that have context
    ctx = backend.paged(q[lo:hi], kc, vc, world.dv, md.prefill_context, scale)
    dec = backend.paged(q[p:], kc, vc, world.dv, md.decode, scale)
    return new, ctx, dec


def full_attention(world: World, scale):
    """Unsharded reference: each new token attends causally to all earlier positions of its sequence."""
    outs, lses = [], []
    for ch, k, v, q in zip(world.plan.chunks, world.keys, world.values, world.queries, strict=True):
        n, total = len(ch.token_ids), ch.start + len(ch.token_ids)
        mask = torch.arange(total, device=q.device)[None, :] <= (ch.start + torch.arange(n, device=q.device))[:, None]
        o, lse = softmax_attention(q[None], k[None], v[None], scale, mask[None])
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses)


def assert_close(a, b, atol=2e-5):
    a, b = a.float(), b.float()
    assert not a.isnan().any()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin], atol=atol, rtol=1e-4 if atol < 1e-3 else 2e-2)


def test_registry_names_the_triton_backend():
    from engine.attention.triton_backend import TritonBackend

    backend = create_backend("triton")
    assert isinstance(backend, TritonBackend) and backend.name == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_flash_attn_without_cuda_is_a_user_error():
    with pytest.raises(UserError, match="needs CUDA"):
        create_backend("flash_attn")


def check_backend(name, arch, dcp_size, interleave, block_size, device="cpu", dtype=torch.float32, atol=2e-5):
    """Per DCP rank, `name` equals the torch backend (cache, prefill, context, decode); the ranks' partials merge
    (merge_partials, the kernel form of the DCP combine, then the new-token merge) to unsharded attention."""
    mla = arch == "mla"
    heads, hkv, dk, dv = (4, 1, 40, 32) if mla else (4, 2, 16, 16)
    scale = 0.3
    plan = make_step(block_size, dcp_size)
    world = World(plan, heads, hkv, dk, dv, mla, device, dtype)
    layout = CacheLayout(num_blocks=16, block_size=block_size, interleave=interleave, dtype=dtype)
    ours, ref = create_backend(name), create_backend("torch")
    partials = []
    for rank in range(dcp_size):
        md_o = runner_metadata(ours, plan, layout, dcp_size, rank, device)
        md_r = runner_metadata(ref, plan, layout, dcp_size, rank, device)
        assert md_o.prefill_context is not None and md_o.decode is not None
        assert md_o.prefill_context_rows == (5, 11)  # the fresh prompts around the chunk attend to no cache
        if dcp_size > 1 and rank == 1:
            assert (md_o.decode.lens == 0).any()  # a 1-token sequence: rank 1 holds none of it
        kc_o, vc_o = world.caches(layout, rank, dcp_size, ours)
        kc_r, vc_r = world.caches(layout, rank, dcp_size, ref)
        got = run_layer(ours, md_o, world, kc_o, vc_o, scale)
        want = run_layer(ref, md_r, world, kc_r, vc_r, scale)
        assert torch.equal(kc_o, kc_r) and (vc_o is None or torch.equal(vc_o, vc_r))
        for (o_g, l_g), (o_w, l_w) in zip(got, want, strict=True):
            assert_close(o_g, o_w, atol)
            assert_close(l_g, l_w, atol)
        partials.append(got)

    ctx = tk.merge_partials(torch.stack([p[1][0] for p in partials]), torch.stack([p[1][1] for p in partials]))
    new_o, new_l = partials[0][0]
    ctx_o, ctx_l = torch.zeros_like(new_o), torch.full_like(new_l, float("-inf"))  # rows without context: none
    ctx_o[5:11], ctx_l[5:11] = ctx
    prefill = tk.merge_partials(torch.stack([new_o, ctx_o]), torch.stack([new_l, ctx_l]))
    decode = tk.merge_partials(torch.stack([p[2][0] for p in partials]), torch.stack([p[2][1] for p in partials]))
    want_o, want_l = full_attention(world, scale)
    assert_close(torch.cat([prefill[0], decode[0]]), want_o, atol)
    assert_close(torch.cat([prefill[1], decode[1]]), want_l, atol)


@pytest.mark.parametrize(
    ("arch", "dcp_size", "interleave", "block_size"),
    [("gqa", 2, 1, 4), ("gqa", 2, 4, 4), ("mla", 2, 2, 8), ("mla", 1, 1, 4)],
)
def test_triton_matches_torch_per_rank_and_merges_to_full_attention(arch, dcp_size, interleave, block_size):
    check_backend("triton", arch, dcp_size, interleave, block_size)


def test_flash_backend_rules_name_the_setting():
    from engine.attention.flash_backend import FlashAttnBackend

    with pytest.raises(UserError, match=r"cache\.block_size"):
        FlashAttnBackend._check_block_size(torch.empty(1, 16, 1, 8))
    FlashAttnBackend._check_block_size(torch.empty(1, 256, 1, 8))
    with pytest.raises(UserError, match=r"model\.dtype"):
        FlashAttnBackend._uses_flash(torch.empty(1, 2, 16), 16, values_in_key=False)
    assert FlashAttnBackend._uses_flash(torch.empty(1, 2, 16, dtype=torch.bfloat16), 16, values_in_key=False)
    assert not FlashAttnBackend._uses_flash(torch.empty(1, 2, 40), 32, values_in_key=True)  # MLA: Triton


HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
NEEDS_FLASH = pytest.mark.skipif(not HAS_FLASH, reason="needs flash-attn")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("name", "arch", "dcp_size", "interleave", "block_size", "dtype"),
    [
        ("triton", "gqa", 2, 1, 16, torch.bfloat16),
        ("triton", "gqa", 2, 4, 4, torch.float32),
        ("triton", "mla", 2, 2, 64, torch.bfloat16),
        ("triton", "mla", 1, 1, 16, torch.float32),
        pytest.param("flash_attn", "gqa", 2, 1, 256, torch.bfloat16, marks=NEEDS_FLASH),
        pytest.param("flash_attn", "gqa", 2, 256, 256, torch.float16, marks=NEEDS_FLASH),
        pytest.param("flash_attn", "mla", 2, 2, 64, torch.bfloat16, marks=NEEDS_FLASH),
    ],
)
def test_gpu_backend_matches_torch(name, arch, dcp_size, interleave, block_size, dtype):
    check_backend(name, arch, dcp_size, interleave, block_size, "cuda", dtype, 1e-4 if dtype == torch.float32 else 3e-2)


# --------------------------------------------------------------------------------------------------------------
# Whole model, tp2 dcp2, through `dcpctl run` (torchrun, gloo)
# --------------------------------------------------------------------------------------------------------------

LENGTHS = [2, 19, 45]  # 2 < dcp * interleave: one rank holds nothing of it at first; 45 is chunked (budget 24)
NEW_TOKENS = 16
MODELS = {
    "mla": (("deepseek_v2", {}), {"parallel.interleave": 2}),
    "gqa-kv1": (("llama", {"num_kv_heads": 1}), {"parallel.interleave": 1, "cache.block_size": 4}),
}


def dcpctl_run(plan, prompts_file, out, overrides):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), *overrides, "--prompts-file", str(prompts_file),
           "--max-tokens", str(NEW_TOKENS), "--ignore-eos", "--logprobs", "1", "--output", str(out)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return read_jsonl(out)


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU check; the GPU script runs its own")
@pytest.mark.parametrize("model", list(MODELS))
def test_tiny_model_tp2_dcp2_triton_gives_hf_tokens(tmp_path, tiny_models, model):
    """The torch backend's tokens are HF's in every layout (test_dcp_equivalence.py), so HF is the reference here."""
    (arch, sizes), settings = MODELS[model]
    folder = tiny_models(arch, **sizes)
    prompts = prompt_ids(len(LENGTHS), LENGTHS, seed=5)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    plan = write_plan(tmp_path, folder, {**settings, "scheduler.max_num_batched_tokens": 24})
    # both DCP combines: the default (ag_rs in the TP group) and the all-to-all
    for combine in ("auto", "a2a"):
        triton = ["parallel.tp=2", "parallel.dcp=2", "attention.backend=triton", f"parallel.dcp_comm_backend={combine}"]
        ours = dcpctl_run(plan, prompts_file, tmp_path / f"triton_{combine}.jsonl", triton)
        for ids, record in zip(prompts, ours, strict=True):
            tokens, logprobs = hf_greedy(folder, ids, NEW_TOKENS)
            assert record["token_ids"] == tokens, f"{combine}: prompt of {len(ids)} tokens diverged"
            diff = max(abs(x["logprob"] - y) for x, y in zip(record["logprobs"], logprobs, strict=True))
            assert diff < LOGPROB_TOL
