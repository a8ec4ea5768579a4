"""The plan schema: typed sections that OmegaConf validates a YAML plan against.

Key names are a contract (other tools read them); README.md's plan reference documents each
field, its default and its rule. Choice-valued fields are plain strings checked in `checks.py`
so that every problem of a plan can be reported at once, with a suggestion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
DEVICES = ("auto", "cpu", "cuda")
DIST_BACKENDS = ("auto", "gloo", "nccl")
CPU_COMMS = ("auto", "shm", "gloo")

CONNECTORS = ("nixl",)
FAILURE_POLICIES = ("fail", "recompute")

# vLLM's names, accepted as aliases.
KEY_ALIASES = {
    "parallel.cp_kv_cache_interleave_size": "parallel.interleave",
    "kv_transfer_config.kv_connector": "disagg.connector",
    "kv_transfer_config.kv_load_failure_policy": "disagg.failure_policy",
    "kv_transfer_config.kv_role": "disagg.kv_role",
}


@dataclass
class ModelSection:
    path: str = MISSING
    dtype: str = "auto"
    max_model_len: int | None = None


@dataclass
class ParallelSection:
    tp: int = 1
    dcp: int = 1
    interleave: int = 1
    pp: int = 1
    # Dense layers with replica ranks (engine.placement): sharded (Helix; TensorRT-LLM cp_type HELIX) | replicated
    dense: str = "sharded"
    # The DCP combine: auto | ag_rs | a2a (vLLM's and SGLang's field and values; auto: a2a with dense=sharded)
    dcp_comm_backend: str = "auto"


@dataclass
class CacheSection:
    block_size: int = 16
    # Bytes with a unit ("2GiB", "512MiB") or a fraction of free device memory ("0.5").
    memory: str = "1GiB"
    dtype: str = "auto"
    prefix_caching: bool = True  # reuse cached KV blocks of identical prompt prefixes


@dataclass
class AttentionSection:
    backend: str = "auto"


@dataclass
class SchedulerSection:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True


@dataclass
class LaunchSection:
    device: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node)
    rdzv_endpoint: str | None = None
    dist_backend: str = "auto"
    cpu_comm: str = "auto"  # CPU tensor collectives: shared memory (one node) or gloo; auto: shm where it can
    threads_per_rank: int = 0  # 0: cores / local ranks


@dataclass
class ServeSection:
    host: str = "127.0.0.1"
    port: int = 8000
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
class Plan:
    name: str = ""
    description: str = ""
    base: str | None = None
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    cache: CacheSection = field(default_factory=CacheSection)
    attention: AttentionSection = field(default_factory=AttentionSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    launch: LaunchSection = field(default_factory=LaunchSection)
    serve: ServeSection = field(default_factory=ServeSection)
    disagg: DisaggSection = field(default_factory=DisaggSection)
