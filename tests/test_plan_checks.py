"""Cross-checks of plans against DESIGN.md's rules and the model config."""

import pytest

from engine.plan.checks import validate_plan_file
from tests.conftest import mla_fields, write_config


def check(make_plan, text, overrides=None, strict=False):
    return validate_plan_file(make_plan(text), overrides, strict=strict)


def messages(report):
    return [e.message for e in report.problems.errors]


def test_valid_plan_resolves_settings(make_plan, llama_folder):
    report = check(
        make_plan,
        f"model: {{path: {llama_folder}}}\nparallel: {{tp: 2, dcp: 2, interleave: 4}}\n"
        "launch: {device: cpu}\ncache: {memory: 1MiB}\n",
    )
    assert report.valid, messages(report)
    res = report.resolved
    assert (res.device, res.dtype, res.cache_dtype, res.backend) == ("cpu", "float32", "float32", "cpu")
    assert res.world_size == 4  # 2 KV heads over tp 2: R = 1, so dcp 2 adds a replica
    assert res.layout.kind == "replica"
    # 2 layers x 2 (K,V) x 1 KV head x 8 dims x 4 bytes = 128 bytes/token/rank; 1 MiB / (16 x 128) = 512 blocks
    assert (res.kv.bytes_per_token, res.kv.num_blocks, res.kv.token_capacity) == (128, 512, 512 * 16 * 2)


def test_interleave_must_divide_block_size(make_plan, llama_folder):
    report = check(
        make_plan, f"model: {{path: {llama_folder}}}\ncache: {{block_size: 64}}\nparallel: {{interleave: 48}}\n"
    )
    assert messages(report) == [
        "parallel.interleave=48 does not divide cache.block_size=64; use one of 1, 2, 4, 8, 16, 32, 64"
    ]
    assert report.problems.errors[0].line == 3


def test_interleave_above_block_size(make_plan, llama_folder):
    report = check(
        make_plan, f"model: {{path: {llama_folder}}}\ncache: {{block_size: 16}}\nparallel: {{interleave: 32}}\n"
    )
    assert "parallel.interleave=32 does not divide cache.block_size=16" in messages(report)[0]


def test_all_problems_reported_at_once(make_plan, llama_folder):
    report = check(
        make_plan,
        f"model: {{path: {llama_folder}, dtype: fp32}}\nparallel: {{tp: 3, pp: 2}}\n"
        "attention: {backend: trition}\nlaunch: {device: cpu, dist_backend: nccl}\n",
    )
    fields = sorted(e.field for e in report.problems.errors)
    assert fields == ["attention.backend", "launch.dist_backend", "model.dtype", "parallel.pp", "parallel.tp"], fields
    text = " | ".join(messages(report))
    assert "model.dtype='fp32' is not one of auto, float32, bfloat16, float16" in text
    assert "(did you mean 'triton'?)" in text
    assert "pipeline parallelism is not supported yet; set parallel.pp=1" in text
    assert "parallel.tp=3 does not divide the model's 8 attention heads; use tp in 1, 2, 4, 8" in text
    assert "launch.dist_backend=nccl needs CUDA" in text


def test_gqa_dcp_inside_tp(make_plan, tmp_path):
    folder = write_config(tmp_path / "kv1", num_key_value_heads=1)
    report = check(make_plan, f"model: {{path: {folder}}}\nparallel: {{tp: 2, dcp: 2}}\nlaunch: {{device: cpu}}\n")
    assert report.valid and report.resolved.layout.kind == "tp" and report.resolved.world_size == 2


def test_dcp_not_matching_replication(make_plan, tmp_path):
    folder = write_config(tmp_path / "kv2", num_key_value_heads=2)
    report = check(make_plan, f"model: {{path: {folder}}}\nparallel: {{tp: 4, dcp: 3}}\n")
    assert messages(report) == [
        "parallel.dcp=3 neither divides nor is a multiple of the KV replication R=2 "
        "(2 KV heads over tp=4); use dcp in 1, 2, 4, 6, 8, 10, 12, 14, 16, or change "
        "parallel.tp"
    ]


def test_mla_model_rules(make_plan, tmp_path):
    folder = write_config(tmp_path / "mla", **mla_fields())
    report = check(
        make_plan,
        f"model: {{path: {folder}}}\nparallel: {{tp: 2, dcp: 2}}\ncache: {{memory: 1MiB}}\nlaunch: {{device: cpu}}\n",
    )
    assert report.valid, messages(report)
    assert report.resolved.layout.kind == "tp" and report.resolved.world_size == 2
    assert report.resolved.kv.bytes_per_token == 2 * (32 + 8) * 4  # latent + rope, one "head", 2 layers, fp32
    report = check(make_plan, f"model: {{path: {folder}}}\nparallel: {{tp: 2}}\n", strict=False)
    folder2 = write_config(tmp_path / "mla_odd", **mla_fields(moe_intermediate_size=33))
    report = check(make_plan, f"model: {{path: {folder2}}}\nparallel: {{tp: 2}}\n")
    assert "parallel.tp=2 does not divide the model's moe_intermediate_size=33" in messages(report)


def test_max_model_len_limit(make_plan, llama_folder):
    report = check(make_plan, f"model: {{path: {llama_folder}, max_model_len: 4096}}\n")
    assert messages(report) == [
        "model.max_model_len=4096 exceeds the model's max_position_embeddings=1024; use at most 1024"
    ]


def test_kv_budget_too_small(make_plan, llama_folder):
    report = check(make_plan, f"model: {{path: {llama_folder}}}\ncache: {{memory: 64KiB}}\nlaunch: {{device: cpu}}\n")
    (message,) = messages(report)
    # 2 layers x 2 x 2 kv heads x 8 dims x 4 B = 256 B/token; 64 KiB = 16 blocks of 16 = 256 tokens < 1024
    assert message == (
        "cache.memory=64KiB holds 256 tokens (16 blocks of 16 per rank x dcp 1), fewer than one "
        "sequence of model.max_model_len=1024; raise cache.memory to at least 256.0 KiB or lower "
        "model.max_model_len"
    )


def test_bad_memory_text(make_plan, llama_folder):
    report = check(make_plan, f"model: {{path: {llama_folder}}}\ncache: {{memory: lots}}\n")
    assert messages(report) == ["cache.memory='lots' is not a size like '2GiB', '512MiB' or a fraction like 0.5"]
    report = check(make_plan, f"model: {{path: {llama_folder}}}\n", ["cache.memory=2.5"])
    assert messages(report) == [
        "cache.memory='2.5' is neither a fraction of free memory (at most 1) nor a whole number of bytes; "
        "write a size with a unit such as '2.5GiB', or a fraction such as 0.5"
    ]


def test_fraction_memory_on_cpu(make_plan, llama_folder):
    report = check(make_plan, f"model: {{path: {llama_folder}}}\ncache: {{memory: 0.01}}\nlaunch: {{device: cpu}}\n")
    assert report.resolved.kv_budget_bytes > 0 and any("of free RAM" in n for n in report.problems.notes)


def test_no_chunked_prefill_needs_budget(make_plan, llama_folder):
    report = check(
        make_plan,
        f"model: {{path: {llama_folder}}}\nscheduler: {{chunked_prefill: false, max_num_batched_tokens: 256}}\n",
    )
    assert any("with chunked_prefill off" in m for m in messages(report))


def test_missing_model_is_a_note_unless_strict(make_plan, tmp_path):
    text = f"model: {{path: {tmp_path / 'absent'}}}\nparallel: {{tp: 2, dcp: 2}}\n"
    report = check(make_plan, text)
    assert report.valid and "model checks skipped" in report.problems.notes[0]
    strict = check(make_plan, text, strict=True)
    assert not strict.valid and "required by --strict" in messages(strict)[0]


def test_unsupported_architecture(make_plan, tmp_path):
    folder = write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    report = check(make_plan, f"model: {{path: {folder}}}\n")
    assert "unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM" in messages(report)[0]


def test_flash_attn_on_cpu_is_an_error(make_plan, llama_folder):
    report = check(
        make_plan, f"model: {{path: {llama_folder}}}\nattention: {{backend: flash_attn}}\nlaunch: {{device: cpu}}\n"
    )
    assert messages(report) == ["attention.backend=flash_attn needs CUDA (launch.device=cuda); use cpu or torch on CPU"]


def test_cpu_backend_on_cuda_is_an_error(make_plan, llama_folder):
    report = check(
        make_plan, f"model: {{path: {llama_folder}}}\nattention: {{backend: cpu}}\nlaunch: {{device: cuda}}\n"
    )
    assert "attention.backend=cpu runs on CPU only; use torch, triton or flash_attn on CUDA" in messages(report)


def test_many_cpu_ranks_warn(make_plan, tmp_path):
    folder = write_config(tmp_path / "kv1", num_key_value_heads=1, num_attention_heads=16)
    report = check(make_plan, f"model: {{path: {folder}}}\nparallel: {{tp: 16}}\nlaunch: {{device: cpu}}\n")
    assert report.valid and any("ranks share cores" in w for w in report.problems.warnings)


def test_cuda_without_gpus(make_plan, llama_folder, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    report = check(make_plan, f"model: {{path: {llama_folder}}}\nparallel: {{tp: 2}}\nlaunch: {{device: cuda}}\n")
    assert "the plan needs 2 GPUs on this node (world size 2 over 1 node(s)) but 0 are visible" in messages(report)[0]


@pytest.mark.parametrize(
    ("launch", "resolved"),
    [
        ("{device: cpu}", "shm"),
        ("{device: cpu, cpu_comm: shm}", "shm"),
        ("{device: cpu, cpu_comm: gloo}", "gloo"),
        ("{device: cpu, nnodes: 2, master_port: 29500}", "gloo"),  # auto: shared memory only within one node
    ],
)
def test_cpu_comm_resolves(make_plan, llama_folder, launch, resolved):
    report = check(make_plan, f"model: {{path: {llama_folder}}}\nparallel: {{tp: 2}}\nlaunch: {launch}\n")
    assert report.valid, messages(report)
    assert report.resolved.cpu_comm == resolved


def test_cpu_comm_shm_needs_one_node_and_cpu(make_plan, llama_folder, monkeypatch):
    plan = f"model: {{path: {llama_folder}}}\nparallel: {{tp: 2}}\n"
    report = check(make_plan, plan + "launch: {device: cpu, cpu_comm: shm, nnodes: 2, master_port: 29500}\n")
    assert messages(report) == [
        "launch.cpu_comm=shm needs every rank on one node, but launch.nnodes=2; set launch.cpu_comm=auto "
        "(gloo between nodes) or launch.nnodes=1"
    ]
    monkeypatch.setattr("engine.devices.cuda_device_count", lambda: 2)
    report = check(make_plan, plan + "launch: {device: cuda, cpu_comm: shm}\n")
    assert messages(report) == [
        "launch.cpu_comm=shm is for CPU ranks, but launch.device resolves to cuda here (NCCL carries the tensors); "
        "set launch.cpu_comm=auto, or launch.device=cpu"
    ]
    assert report.resolved.cpu_comm == ""


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("launch: {cpu_comm: shared}\n", "launch.cpu_comm='shared' is not one of auto, shm, gloo"),
        ("launch: {nnodes: 2}\n", "a multi-node launch needs launch.master_port"),
        ("launch: {nnodes: 2, node_rank: 2, master_port: 29500}\n", "launch.node_rank=2 must be in 0..1"),
        ("serve: {port: 70000}\n", "serve.port=70000 is not a port number"),
        ("scheduler: {max_num_seqs: 0}\n", "scheduler.max_num_seqs=0 must be >= 1"),
        ("cache: {block_size: 0}\n", "cache.block_size=0 must be >= 1"),
    ],
)
def test_static_rules(make_plan, llama_folder, text, fragment):
    report = check(make_plan, f"model: {{path: {llama_folder}}}\n{text}")
    assert any(fragment in m for m in messages(report)), messages(report)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "parallel: {dense: shard}\n",
            "parallel.dense='shard' is not one of replicated, sharded (did you mean 'sharded'?)",
        ),
        ("parallel: {dcp_comm_backend: a2 a}\n", "parallel.dcp_comm_backend='a2 a' is not one of auto, ag_rs, a2a"),
        (
            "parallel: {dcp_comm_backend: fi_a2a}\n",
            "parallel.dcp_comm_backend='fi_a2a' is SGLang's FlashInfer MNNVL kernel and is not supported; use a2a",
        ),
    ],
)
def test_dense_placement_and_comm_backend_choices(make_plan, llama_folder, text, fragment):
    report = check(make_plan, f"model: {{path: {llama_folder}}}\n{text}")
    assert any(fragment in m for m in messages(report)), messages(report)
    assert report.resolved.placement is None


def test_placement_notes_without_replicas_and_a2a_without_dcp(make_plan, llama_folder):
    report = check(
        make_plan,
        f"model: {{path: {llama_folder}}}\nparallel: {{dense: sharded, dcp_comm_backend: a2a}}\n"
        "launch: {device: cpu}\ncache: {memory: 1MiB}\n",
    )
    assert report.valid, messages(report)
    assert report.resolved.placement is not None and not report.resolved.placement.sharded
    assert "parallel.dcp_comm_backend=a2a has no effect with parallel.dcp=1" in report.problems.notes
    assert any(n.startswith("parallel.dense=sharded: no replica ranks (dcp=1)") for n in report.problems.notes)


def test_sharded_fallback_is_a_note_not_an_error(make_plan, tmp_path):
    folder = write_config(tmp_path / "m", num_key_value_heads=2, intermediate_size=126)
    report = check(
        make_plan,
        f"model: {{path: {folder}}}\nparallel: {{dcp: 4, dense: sharded}}\nlaunch: {{device: cpu}}\n"
        "cache: {memory: 1MiB}\n",
    )
    assert report.valid, messages(report)
    assert report.resolved.placement.sharded and report.resolved.placement.mlp.group == "tp"
    assert (
        "layers 0-1 mlp: not split over the 4 ranks (intermediate_size=126 % 4 != 0); split over tp=1 as with "
        "parallel.dense=replicated" in report.problems.notes
    )


def test_defaults_are_helix_with_a2a_on_replica_layouts_and_silent_without(make_plan, tmp_path, llama_folder):
    folder = write_config(tmp_path / "kv2", num_key_value_heads=2)
    cpu = "launch: {device: cpu}\ncache: {memory: 1MiB}\n"
    replica = check(make_plan, f"model: {{path: {folder}}}\nparallel: {{dcp: 2}}\n{cpu}")
    assert replica.valid, messages(replica)
    placement = replica.resolved.placement
    assert (placement.dense, placement.sharded, placement.comm_backend) == ("sharded", True, "a2a")
    # the placement before Helix stays selectable, and its combine (auto) stays the all-gather + reduce-scatter
    old = check(make_plan, f"model: {{path: {folder}}}\nparallel: {{dcp: 2, dense: replicated}}\n{cpu}")
    assert (old.resolved.placement.sharded, old.resolved.placement.comm_backend) == (False, "ag_rs")
    # without replica ranks the defaults change nothing and say nothing
    plain = check(make_plan, f"model: {{path: {llama_folder}}}\n{cpu}")
    assert plain.valid and not plain.resolved.placement.sharded
    assert not [n for n in plain.problems.notes if "parallel.dense" in n or "dcp_comm_backend" in n]


def test_cpu_kv_budget_beyond_this_machines_ram(make_plan, llama_folder, monkeypatch):
    from engine import devices

    monkeypatch.setattr(devices, "total_memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr(devices, "available_memory_bytes", lambda: 4 << 30)
    text = f"model: {{path: {llama_folder}}}\nparallel: {{dcp: 2}}\nlaunch: {{device: cpu}}\n"
    report = check(make_plan, text + "cache: {memory: 1TB}\n")
    assert messages(report) == [
        "cache.memory=1TB x 2 local rank(s) is 1.8 TiB of KV cache, more than this machine's 8.0 GiB of RAM; "
        "lower cache.memory (or give a fraction of free RAM, e.g. 0.5)"
    ]
    report = check(make_plan, text + "cache: {memory: 3GiB}\n")
    assert report.valid and any("more than the 4.0 GiB of RAM free now" in w for w in report.problems.warnings)
    assert check(make_plan, text + "cache: {memory: 1GiB}\n").problems.warnings == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.dcp=2", "launch.master_addr=999.9.9.9"],
            "launch.master_addr=999.9.9.9 does not resolve to an address; on one node use 127.0.0.1",
        ),
        (["serve.host=999.1.1.1"], "serve.host=999.1.1.1 does not resolve to an address"),
        (["serve.host=192.0.2.77"], "serve.host=192.0.2.77 (192.0.2.77) is not an address of this machine"),
    ],
)
def test_addresses_this_node_binds_must_be_its_own(make_plan, llama_folder, overrides, message):
    report = check(make_plan, f"model: {{path: {llama_folder}}}\nlaunch: {{device: cpu}}\n", overrides)
    assert any(m.startswith(message) for m in messages(report)), messages(report)
    good = ["parallel.dcp=2", "launch.master_addr=localhost", "serve.host=0.0.0.0"]
    assert check(make_plan, f"model: {{path: {llama_folder}}}\nlaunch: {{device: cpu}}\n", good).valid


@pytest.mark.parametrize(
    ("spelling", "resolved"), [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")]
)
def test_fp8_cache_holds_twice_the_tokens_of_bfloat16(make_plan, llama_folder, spelling, resolved):
    """vLLM's --kv-cache-dtype spellings (fp8 is e4m3); one byte per element: twice bfloat16's tokens per rank."""
    text = f"model: {{path: {llama_folder}}}\nparallel: {{dcp: 2, interleave: 4}}\nlaunch: {{device: cpu}}\n"
    half = check(make_plan, text + "cache: {memory: 1MiB, dtype: bfloat16}\n").resolved
    fp8 = check(make_plan, text + f"cache: {{memory: 1MiB, dtype: {spelling}}}\n").resolved
    assert (fp8.dtype, fp8.cache_dtype) == ("float32", resolved)
    # 2 layers x 2 (K,V) x 2 KV heads x 8 dims x 1 byte
    assert (fp8.kv.bytes_per_token, half.kv.bytes_per_token) == (64, 128)
    assert fp8.kv.token_capacity == 2 * half.kv.token_capacity
    assert f"decode attention: engine paged decode kernel on an {resolved} cache" in fp8.cpu_paths.describe()


def test_fp8_is_a_cache_dtype_only(make_plan, llama_folder):
    report = check(make_plan, f"model: {{path: {llama_folder}, dtype: fp8}}\ncache: {{dtype: fp8_e4m4}}\n")
    assert messages(report) == [
        "model.dtype='fp8' is not one of auto, float32, bfloat16, float16",
        "cache.dtype='fp8_e4m4' is not one of auto, float32, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2 "
        "(did you mean 'fp8_e4m3'?)",
    ]
