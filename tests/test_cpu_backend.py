"""The engine's C++ CPU kernels against torch and HF: the GEMV against F.linear, RMSNorm against HF's
(bitwise in bfloat16), and the `cpu` attention backend against the torch reference per DCP rank (its
store and decode kernels), merged over ranks to unsharded attention, and on a whole model against HF.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine import dcp
from engine.attention import kv_cache
from engine.attention.backend import AttentionMetadata
from engine.attention.cpu_backend import CpuBackend
from engine.attention.registry import create_backend
from engine.attention.torch_backend import softmax_attention
from engine.kernels import cpu_kernels
from engine.kernels.cpu_gemm import PackableLinear
from engine.kernels.cpu_isa import detect
from engine.kernels.cpu_paths import GEMV_MAX_ROWS
from engine.layers.rotary import RotaryEmbedding
from tests.oracle import hf_greedy, prompt_ids, write_plan
from tests.test_dcp_equivalence import dcpctl_run
from tests.test_triton_backend import check_backend

NEEDS_KERNELS = pytest.mark.skipif(not cpu_kernels.cpu_kernels_available(), reason="the CPU kernels did not build here")


@NEEDS_KERNELS
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_f_linear(dtype, atol, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(333, 70, generator=g).to(dtype)  # odd sizes: no multiple of a vector width
    bias = torch.randn(333, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 70, generator=g).to(dtype)
    out = cpu_kernels.gemv(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, 333)
    # bf16: the same fp32 accumulation then one rounding, so the bits agree with oneDNN's
    want = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(out, want, atol=atol, rtol=0 if atol == 0 else 1e-5)


@NEEDS_KERNELS
def test_linear_layers_take_the_gemv_for_few_rows_only():
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    layer.pack()
    assert layer.gemv_rows == GEMV_MAX_ROWS
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(layer.project(x), x @ layer.weight.T, atol=1e-5, rtol=1e-5)


@NEEDS_KERNELS
def test_gemv_rejects_mismatched_shapes():
    with pytest.raises(RuntimeError, match=r"x \[m, k\] and w \[n, k\]"):
        cpu_kernels.gemv(torch.ones(1, 3), torch.ones(4, 5))


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_hf(dtype, with_residual):
    g = torch.Generator().manual_seed(3)
    hf = LlamaRMSNorm(200, eps=1e-6).to(dtype)
    hf.weight.data = torch.randn(200, generator=g).to(dtype)
    x, residual = torch.randn(7, 200, generator=g).to(dtype), torch.randn(7, 200, generator=g).to(dtype)
    out, summed = torch.ops.dcpctl.rms_norm(x, residual if with_residual else None, hf.weight, 1e-6)
    want_input = x + residual if with_residual else x
    if with_residual:
        assert torch.equal(summed, want_input)
    if dtype == torch.bfloat16:  # rounded where HF rounds: the same bits
        assert torch.equal(out, hf(want_input))
    else:
        torch.testing.assert_close(out, hf(want_input), atol=2e-6, rtol=1e-6)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_kernel_gives_the_torch_bits(dtype, interleaved):
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4)
    rope = RotaryEmbedding(cfg, 64, 4096, interleaved, torch.device("cpu"))
    qkv = torch.randn(6, 7, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = qkv[:, 1:6]  # a strided view, as the attention layers pass q and k
    cos, sin = rope.lookup(torch.tensor([0, 1, 9, 300, 2047, 4095]))
    assert torch.equal(rope.apply(x, cos, sin), rope.apply_torch(x, cos, sin))


@NEEDS_KERNELS
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "cache_dtype", "dcp_size", "interleave", "block", "interleaved"),
    [
        (9, 3, torch.float32, torch.float32, 1, 1, 64, False),  # SmolLM2 at tp 1
        (9, 3, torch.bfloat16, torch.bfloat16, 2, 1, 16, False),  # every other token on this rank
        (8, 2, torch.float32, torch.bfloat16, 2, 4, 8, False),  # runs of 4; a bf16 cache under an fp32 model
        (4, 4, torch.bfloat16, torch.bfloat16, 3, 2, 4, True),  # no GQA; adjacent pairs rotate
    ],
)
def test_rotary_store_kv_gives_the_bits_of_rotary_then_store_kv(
    four_threads, threads, heads, kv_heads, dtype, cache_dtype, dcp_size, interleave, block, interleaved
):
    """The fused op against the ops it replaces (torch's rotary, then `store_kv` of k and v) and against the torch
    backend's path: the rotated q and k and every byte of the cache storage, tokens another rank owns included."""
    torch.set_num_threads(threads)
    dim, tokens = 64, 100  # enough for the kernel to split them over 4 threads
    g = torch.Generator().manual_seed(heads * 100 + dcp_size * 10 + interleave)
    cfg = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads)
    rope = RotaryEmbedding(cfg, dim, 4096, interleaved, torch.device("cpu"))
    # each token its own sequence of 2 blocks (so distinct slots), past the first block and on either side of a
    # block boundary
    virtual = block * dcp_size
    positions = torch.randint(0, 2 * virtual, (tokens,), generator=g)
    positions[:4] = torch.tensor([virtual - 1, virtual, 0, 2 * virtual - 1])
    blocks = 2 * tokens
    tables = torch.randperm(blocks, generator=g).view(tokens, 2).tolist()
    rank = dcp_size - 1
    slots = torch.tensor(
        [dcp.slot(int(p), rank, tables[t], block, interleave, dcp_size) for t, p in enumerate(positions)]
    )
    if dcp_size > 1:
        assert (slots < 0).any() and (slots >= 0).any()  # some tokens are another rank's: not stored here
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 5, generator=g).to(dtype)[:, 5:].view(tokens, -1, dim)
    cos, sin = rope.lookup(positions)

    def storage_and_views():
        storage, layers = kv_cache.allocate(
            2, blocks, block, kv_heads, dim, False, cache_dtype, torch.device("cpu"), True
        )
        storage.copy_(torch.randn(storage.shape, generator=torch.Generator().manual_seed(1)))  # stale bytes
        return storage, layers[1]

    storage, (kc, vc) = storage_and_views()
    got = torch.cat(cpu_kernels.rotary_store_kv(qkv, cos, sin, interleaved, kc, vc, slots), dim=1)
    want_storage, (want_kc, want_vc) = storage_and_views()
    want = rope.apply_torch(qkv[:, : heads + kv_heads], cos, sin)
    cpu_kernels.store_kv(want[:, heads:], want_kc, slots)
    cpu_kernels.store_kv(qkv[:, heads + kv_heads :], want_vc, slots)
    assert torch.equal(got, want) and torch.equal(storage, want_storage)
    if cache_dtype != dtype:
        return  # the torch backend's store needs one dtype
    torch_storage, (torch_kc, torch_vc) = storage_and_views()
    reference = create_backend("torch")
    metadata = AttentionMetadata(reference, slots, num_prefill_tokens=0, num_decode_tokens=tokens)
    reference.prepare(metadata)
    assert torch.equal(
        torch.cat(reference.rotate_and_write(qkv, rope, cos, sin, torch_kc, torch_vc, metadata), 1), want
    )
    assert torch.equal(torch_storage, want_storage)


@pytest.fixture
def four_threads():
    """4 intra-op threads (even on fewer cores), so that paged_decode splits long contexts."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@NEEDS_KERNELS
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dk", "dv"),
    [(8, 1, 64, 64), (6, 2, 128, 128), (4, 1, 40, 32)],  # AVX-512 vector path: 64 and 128 dims; 40: scalar
)
def test_paged_decode_splits_long_contexts_exactly(four_threads, heads, kv_heads, dk, dv):
    """3 (sequence, KV head) pairs for 4 threads: the 300-token context runs as 3 chunks, merged by LSE."""
    g = torch.Generator().manual_seed(7)
    block, lengths = 16, [300, 0, 77]  # 0: a rank holding none of that sequence
    cache = torch.randn(60, block, kv_heads, dk, generator=g)
    values = None if dv < dk else torch.randn(60, block, kv_heads, dv, generator=g)
    tables = torch.randperm(60, generator=g)[: 3 * 19].view(3, 19)
    q = torch.randn(3, heads, dk, generator=g)
    out, lse = cpu_kernels.paged_decode(q, cache, values, tables, torch.tensor(lengths), 0.2, dv)
    for s, n in enumerate(lengths):
        if n == 0:
            assert not out[s].any() and torch.isneginf(lse[s]).all()
            continue
        keys = cache[tables[s]].flatten(0, 1)[:n]
        vals = keys[..., :dv] if values is None else values[tables[s]].flatten(0, 1)[:n]
        want_o, want_l = softmax_attention(q[s][None, None], keys[None], vals[None], 0.2, None)
        torch.testing.assert_close(out[s], want_o[0, 0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse[s], want_l[0, 0], atol=2e-5, rtol=1e-5)


@NEEDS_KERNELS
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "dtype"),
    [
        (9, 3, 64, 64, torch.float32),  # SmolLM2: a group of 3, the engine's block size
        (9, 3, 64, 16, torch.bfloat16),
        (6, 2, 128, 8, torch.float32),  # 128 dims; blocks of one AVX2 group of keys
        (10, 2, 128, 12, torch.bfloat16),  # a group of 5 (AVX2: 4 heads per pass, then 1); blocks end mid-group
        (8, 4, 64, 5, torch.float32),  # a group of 2; blocks of 5
        (4, 4, 64, 16, torch.bfloat16),  # no GQA
        (8, 1, 64, 64, torch.bfloat16),  # a group of 8 (AVX2: 4 + 4)
        (12, 2, 64, 16, torch.float32),  # a group of 6 (AVX-512: keys and values 4 + 2 heads per pass)
        (20, 2, 64, 64, torch.bfloat16),  # a group of 10 (AVX512-BF16 keys 8 + 2, else 4 + 4 + 2; values 4 + 4 + 2)
    ],
)
def test_paged_decode_ragged_lengths_per_block_size_and_group(threads, heads, kv_heads, dim, block, dtype):
    """Lengths off multiples of 8 and 16 and of the block, read through the engine's own layer views (head-major
    tiles, block-major across layers), against fp32 attention over the same cache values: the vector paths
    (AVX-512, or AVX2 here and in the forced-AVX2 run of tests/test_cpu_isa.py) take 64 and 128 dims."""
    lengths = [1, 7, 8, 9, 17, 63, 64, 65, 130, 200]
    per_seq = -(-max(lengths) // block)
    blocks = len(lengths) * per_seq + 1
    _, views = kv_cache.allocate(2, blocks, block, kv_heads, dim, False, dtype, torch.device("cpu"), True)
    keys, values = views[1]
    g = torch.Generator().manual_seed(block * heads)
    for cache in (keys, values):
        cache.copy_(torch.randn(cache.shape, generator=g))
    tables = torch.randperm(blocks, generator=g)[: len(lengths) * per_seq].view(len(lengths), per_seq)
    q = torch.randn(len(lengths), heads, dim, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = cpu_kernels.paged_decode(q, keys, values, tables, torch.tensor(lengths), dim**-0.5, dim)
    finally:
        torch.set_num_threads(before)
    # bf16: the output is rounded to bf16
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for s, n in enumerate(lengths):
        k = keys[tables[s]].flatten(0, 1)[:n].float()
        v = values[tables[s]].flatten(0, 1)[:n].float()
        want_o, want_l = softmax_attention(q[s].float()[None, None], k[None], v[None], dim**-0.5, None)
        torch.testing.assert_close(out[s].float(), want_o[0, 0], **tol)
        torch.testing.assert_close(lse[s], want_l[0, 0], atol=5e-5, rtol=1e-5)


@NEEDS_KERNELS
def test_registry_names_the_cpu_backend():
    backend = create_backend("cpu")
    assert isinstance(backend, CpuBackend) and backend.name == "cpu" and backend.kernels


@NEEDS_KERNELS
@pytest.mark.parametrize(
    ("arch", "dcp_size", "interleave", "block_size", "dtype"),
    [
        ("gqa", 1, 1, 4, torch.float32),
        ("gqa", 2, 1, 4, torch.float32),
        ("gqa", 2, 4, 8, torch.bfloat16),
        ("mla", 2, 2, 8, torch.float32),
        ("mla", 1, 1, 4, torch.bfloat16),
    ],
)
def test_cpu_backend_matches_torch_per_rank_and_merges_to_full_attention(arch, dcp_size, interleave, block_size, dtype):
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    check_backend("cpu", arch, dcp_size, interleave, block_size, dtype=dtype, atol=atol)


def test_a_failed_build_is_one_line_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # a fresh kernels cache
    source = tmp_path / "broken.cpp"
    source.write_text("#error broken on purpose\n")
    problem = cpu_kernels.build_kernels((source,), "dcpctl_broken_test", cpu_kernels.BASE_CFLAGS)
    assert problem is not None and "\n" not in problem and "dcpctl_broken_test" in problem
    log = cpu_kernels.kernels_dir() / "dcpctl_broken_test" / "error.log"
    assert problem.endswith(str(log)) and "broken on purpose" in log.read_text()


def test_no_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    problem = cpu_kernels.build_kernels(cpu_kernels.SOURCES, "dcpctl_no_compiler_test", cpu_kernels.BASE_CFLAGS)
    assert problem == "no C++ compiler 'no-such-compiler' on PATH; install g++ or set CXX"


@pytest.mark.multiproc
def test_engine_without_its_kernels_matches_hf(tmp_path, tiny_models, monkeypatch):
    """DCPCTL_CPU_KERNELS=0 (or no compiler): torch's kernels throughout, the same tokens as HF."""
    folder = tiny_models("llama")
    prompts = prompt_ids(3, [1, 17, 40], seed=4)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    monkeypatch.setenv("DCPCTL_CPU_KERNELS", "0")
    plan = write_plan(tmp_path, folder, {"attention.backend": "cpu"})
    records, _ = dcpctl_run(plan, prompts_file, tmp_path / "out.jsonl", tmp_path / "stats", new_tokens=16)
    for ids, record in zip(prompts, records, strict=True):
        assert record["token_ids"] == hf_greedy(folder, ids, 16)[0]


def test_each_torch_install_gets_its_own_build(monkeypatch):
    """Two venvs sharing ~/.cache/dcpctl/kernels must not rebuild over each other at every switch."""
    isa = detect()
    here = cpu_kernels.build_name(isa)
    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu_kernels.build_name(isa) != here


@pytest.mark.parametrize(
    "settings",
    [{"cache.dtype": "float16"}, {"cache.dtype": "bfloat16"}, {"model.dtype": "float16"}],
    ids=["fp16-cache", "bf16-cache", "fp16-model"],
)
def test_a_narrower_cache_or_an_fp16_model_runs_on_both_cpu_backends(tmp_path, tiny_models, settings):
    """A cache dtype other than the model's, and float16 (which the engine's kernels do not take: the cpu backend
    falls back to the torch paths), run to the end on the cpu and torch backends with the same tokens; and a cache
    narrower than the fp32 model changes no greedy token of HF's fp32 here."""
    from engine import LLM, SamplingParams

    folder = tiny_models("llama")
    prompts = prompt_ids(3, [1, 17, 40], seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "torch"):
        plan = write_plan(tmp_path, folder, {**settings, "attention.backend": backend}, name=f"{backend}.yaml")
        with LLM(plan) as llm:
            tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert tokens["cpu"] == tokens["torch"]
    if "cache.dtype" in settings:
        assert tokens["cpu"] == [hf_greedy(folder, ids, 12)[0] for ids in prompts]
