"""A plan as TensorRT-LLM's `trtllm-serve` line and its `--extra_llm_api_options` YAML (one per instance of a P/D
plan: the context and the generation servers), with every TensorRT-LLM rule it breaks.

DCP maps to Helix (`context_parallel_size`, `cp_config: {cp_type: HELIX}`): the world is
tensor_parallel_size x context_parallel_size, so tensor_parallel_size is the plan's world size over its dcp.
"""

from __future__ import annotations

from typing import Any

from engine.peers.export import Export, Gap, Instance, PlanFacts, pd_ports, prefixed, uncarried_gaps
from engine.plan.kv_sizing import parse_memory
from engine.plan.schema import Plan

FP8_E4M3 = ("fp8", "fp8_e4m3")
HELIX = "TensorRT-LLM Helix parallelism (arXiv 2507.07120; docs/source/features/disagg-serving.md, cp_config)"
LLM_API = "TensorRT-LLM LLM API arguments (tensorrt_llm/llmapi/llm_args.py)"
CARRIED = {
    "model.path",
    "model.dtype",
    "model.max_model_len",
    "launch.device",
    "parallel.tp",
    "parallel.dcp",
    "parallel.interleave",
    "parallel.dense",
    "cache.block_size",
    "cache.memory",
    "cache.prefix_caching",
    "scheduler.max_num_seqs",
    "scheduler.max_num_batched_tokens",
    "scheduler.chunked_prefill",
    "serve.host",
    "serve.port",
    "disagg.connector",
    "disagg.prefill_port",
    "disagg.decode_port",
    "speculative_config.method",
    "speculative_config.num_speculative_tokens",
    "speculative_config.prompt_lookup_max",
}


def _helix_gaps(facts: PlanFacts, side: str, pd: bool) -> tuple[list[Gap], int]:
    """The TensorRT-LLM rules the side breaks, and the context_parallel_size of the closest layout it runs."""
    p = facts.plan.parallel
    prefix = f"{side}: " if side else ""
    gaps = []
    if facts.device == "cpu":
        gaps.append(
            Gap(
                "launch.device",
                f"{prefix}TensorRT-LLM runs on NVIDIA GPUs only (launch.device=cpu)",
                LLM_API,
                blocking=True,
                closest=f"{prefix}launch.device cpu -> cuda",
            )
        )
    if p.dcp == 1:
        return gaps, 1
    if facts.is_mla is False:
        gaps.append(
            Gap(
                "layout",
                f"{prefix}Helix (context_parallel_size > 1) is for MLA models; this model is GQA",
                HELIX,
                blocking=True,
                closest=f"{prefix}parallel.dcp {p.dcp} -> 1",
            )
        )
    if p.interleave != facts.plan.cache.block_size:
        gaps.append(
            Gap(
                "parallel.interleave",
                f"{prefix}Helix shards whole KV blocks: interleave must equal cp_config.tokens_per_block = "
                f"kv_cache_config.tokens_per_block (interleave={p.interleave}, "
                f"block_size={facts.plan.cache.block_size})",
                HELIX,
                blocking=True,
                closest=f"{prefix}parallel.interleave {p.interleave} -> {facts.plan.cache.block_size}",
            )
        )
    gaps.append(Gap("layout", f"{prefix}Helix needs Blackwell GPUs (SM100 or newer)", HELIX))
    if not pd:
        gaps.append(
            Gap(
                "layout",
                "Helix runs on the generation servers of disaggregated serving: deploy this layout as the "
                "decode side of a P/D plan (a context server with context_parallel_size 1)",
                HELIX,
            )
        )
    if p.tp != facts.world_size // p.dcp:
        gaps.append(
            Gap(
                "parallel.tp",
                f"{prefix}Helix runs attention KV-parallel over context_parallel_size={p.dcp} with "
                f"tensor_parallel_size={facts.world_size // p.dcp}; the dense layers are tensor parallel over all "
                f"{facts.world_size} ranks (dcpctl splits attention heads over tp={p.tp} inside each DCP group: same "
                "world size, same KV sharding)",
                HELIX,
            )
        )
    closest_gqa = facts.is_mla is False
    return gaps, 1 if closest_gqa else p.dcp


def llm_api_config(facts: PlanFacts, role: str, cp: int) -> dict[str, Any]:
    """The `--extra_llm_api_options` YAML of one server."""
    plan = facts.plan
    p, c, s = plan.parallel, plan.cache, plan.scheduler
    config: dict[str, Any] = {"tensor_parallel_size": facts.world_size // p.dcp if cp > 1 else p.tp}
    if cp > 1:
        config["context_parallel_size"] = cp
        config["cp_config"] = {"cp_type": "HELIX", "tokens_per_block": c.block_size}
    kv: dict[str, Any] = {"tokens_per_block": c.block_size, "enable_block_reuse": c.prefix_caching}
    _, fraction = parse_memory(c.memory)
    if fraction is not None:
        kv["free_gpu_memory_fraction"] = fraction
    if c.dtype in FP8_E4M3:
        kv["dtype"] = "fp8"  # TensorRT-LLM's FP8 KV cache is e4m3
    config["kv_cache_config"] = kv
    config["dtype"] = plan.model.dtype
    if facts.max_model_len:
        config["max_seq_len"] = facts.max_model_len
    config["max_batch_size"] = s.max_num_seqs
    config["max_num_tokens"] = s.max_num_batched_tokens
    config["enable_chunked_prefill"] = s.chunked_prefill
    spec = plan.speculative_config
    if spec.method == "ngram":
        config["speculative_config"] = {
            "decoding_type": "NGram",
            "max_draft_len": spec.num_speculative_tokens,
            "max_matching_ngram_size": spec.prompt_lookup_max or spec.prompt_lookup_min or 5,
        }
    if role != "serve":
        config["cache_transceiver_config"] = {"backend": plan.disagg.connector.upper()}
    return config


def _memory_gap(facts: PlanFacts) -> list[Gap]:
    size, _ = parse_memory(facts.plan.cache.memory)
    if size is None:
        return []
    return [
        Gap(
            "cache.memory",
            f"cache.memory={facts.plan.cache.memory} (a size): TensorRT-LLM sizes the KV cache by "
            "kv_cache_config.free_gpu_memory_fraction or max_tokens; not carried over",
            LLM_API,
        )
    ]


def _instance(facts: PlanFacts, role: str, port: int, cp: int) -> Instance:
    plan = facts.plan
    config_file = f"{plan.name}.{role}.trtllm.yaml" if role != "serve" else f"{plan.name}.trtllm.yaml"
    argv = ["trtllm-serve", facts.model_arg, "--host", plan.serve.host, "--port", str(port)]
    argv += ["--extra_llm_api_options", config_file]
    return Instance(role, argv, config=llm_api_config(facts, role, cp), config_file=config_file)


def _carried(plan: Plan) -> set[str]:
    """The fields TensorRT-LLM has a key for in this plan (its FP8 KV cache is e4m3 only)."""
    return CARRIED | {"cache.dtype"} if plan.cache.dtype in FP8_E4M3 else CARRIED


def trtllm_export(facts: PlanFacts) -> Export:
    """The plan as trtllm-serve lines and YAML; gaps for every rule it breaks and every field it has no key for."""
    plan = facts.plan
    gaps = uncarried_gaps(plan, _carried(plan), "TensorRT-LLM", LLM_API)
    if facts.prefill is None:
        helix, cp = _helix_gaps(facts, "", pd=False)
        instance = _instance(facts, "serve", plan.serve.port, cp)
        return Export("trtllm", plan.name, facts.source, [instance], helix + gaps + _memory_gap(facts))
    prefill = facts.prefill.plan
    gaps += [prefixed(g, "prefill") for g in uncarried_gaps(prefill, _carried(prefill), "TensorRT-LLM", LLM_API)]
    ports = pd_ports(plan)
    gaps.append(
        Gap(
            "serve.port",
            f"the router is `trtllm-serve disaggregated -c disagg.yaml` on port {plan.serve.port}, its "
            f"context_servers at port {ports['prefill']} and generation_servers at port {ports['decode']}",
            "TensorRT-LLM docs/source/features/disagg-serving.md",
        )
    )
    instances = []
    for side, side_facts in (("prefill", facts.prefill), ("decode", facts)):
        helix, cp = _helix_gaps(side_facts, side, pd=True)
        gaps += helix + [prefixed(g, side) for g in _memory_gap(side_facts)]
        instances.append(_instance(side_facts, side, ports[side], cp))
    return Export("trtllm", plan.name, facts.source, instances, gaps)
