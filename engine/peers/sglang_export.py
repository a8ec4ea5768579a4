"""A plan as `python -m sglang.launch_server ...` lines (one per instance of a P/D plan), with every SGLang rule it
breaks. `SGLANG_FLAGS` is the one table of SGLang's names for plan fields (import reads it back)."""

from __future__ import annotations

import math

from engine.peers.export import Export, Gap, Instance, PlanFacts, pd_ports, prefixed, uncarried_gaps
from engine.plan.kv_sizing import parse_memory

SERVER_ARGS = "SGLang docs/advanced_features/server_arguments.md"
LAUNCH = ["python", "-m", "sglang.launch_server"]
BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port

# SGLang's command-line flag for the same setting
SGLANG_FLAGS = {
    "model.path": "--model-path",
    "model.dtype": "--dtype",
    "model.max_model_len": "--context-length",
    "parallel.tp": "--tp-size",
    "parallel.dcp": "--dcp-size",
    "parallel.dcp_comm_backend": "--dcp-comm-backend",
    "cache.block_size": "--page-size",
    "cache.memory": "--mem-fraction-static",
    "cache.dtype": "--kv-cache-dtype",
    "cache.prefix_caching": "--disable-radix-cache",
    "scheduler.max_num_seqs": "--max-running-requests",
    "scheduler.max_num_batched_tokens": "--max-prefill-tokens",
    "scheduler.chunked_prefill": "--chunked-prefill-size",
    "serve.host": "--host",
    "serve.port": "--port",
    "serve.model_name": "--served-model-name",
    "launch.device": "--device",
    "launch.nnodes": "--nnodes",
    "launch.node_rank": "--node-rank",
}
# cache.dtype -> SGLang's --kv-cache-dtype (vLLM's `fp8` spelling is e4m3 in both engines)
SGLANG_KV_DTYPES = {"bfloat16": "bfloat16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
CARRIED = {*SGLANG_FLAGS, "parallel.interleave", "disagg.connector", "disagg.prefill_port", "disagg.decode_port"}


def _layout_gaps(facts: PlanFacts, side: str) -> tuple[list[Gap], int, int]:
    """The SGLang rules the layout breaks, and the dcp and interleave of the closest layout it runs."""
    p = facts.plan.parallel
    prefix = f"{side}: " if side else ""
    gaps, dcp, interleave = [], p.dcp, p.interleave
    if not facts.tp_reuses_ranks:
        dcp = math.gcd(p.tp, p.dcp)
        gaps.append(
            Gap(
                "layout",
                f"{prefix}SGLang runs DCP inside the TP group: --tp-size must be divisible by --dcp-size "
                f"(tp={p.tp}, dcp={p.dcp}); dcpctl's replica ranks (world size {facts.world_size}) have no SGLang "
                "equivalent",
                f"{SERVER_ARGS} (--dcp-size)",
                blocking=True,
                closest=f"{prefix}parallel.dcp {p.dcp} -> {dcp}",
            )
        )
    if dcp > 1 and interleave != 1:
        gaps.append(
            Gap(
                "parallel.interleave",
                f"{prefix}SGLang's DCP interleaves single tokens only (parallel.interleave={interleave}; it has no "
                "interleave setting): a P/D hand-off then moves one run per token instead of whole blocks",
                f"{SERVER_ARGS} (--dcp-size: token interleave only)",
                blocking=True,
                closest=f"{prefix}parallel.interleave {interleave} -> 1",
            )
        )
        interleave = 1
    return gaps, dcp, interleave


def _memory(facts: PlanFacts) -> tuple[list[str], list[Gap]]:
    _, fraction = parse_memory(facts.plan.cache.memory)
    if fraction is not None:
        gap = Gap(
            "cache.memory",
            f"cache.memory={facts.plan.cache.memory} is dcpctl's fraction of free memory for the KV cache; "
            "SGLang's --mem-fraction-static is the fraction of the device for weights and KV",
            f"{SERVER_ARGS} (--mem-fraction-static)",
        )
        return ["--mem-fraction-static", str(fraction)], [gap]
    gap = Gap(
        "cache.memory",
        f"cache.memory={facts.plan.cache.memory} (a size): SGLang sizes its KV pool by --mem-fraction-static "
        "only; not carried over",
        f"{SERVER_ARGS} (--mem-fraction-static)",
    )
    return [], [gap]


def launch_argv(facts: PlanFacts, dcp: int, port: int) -> tuple[list[str], list[Gap]]:
    """`python -m sglang.launch_server ...` for one instance, and the gaps of its settings."""
    plan = facts.plan
    p, c, s = plan.parallel, plan.cache, plan.scheduler
    argv = [*LAUNCH, "--model-path", facts.model_arg, "--tp-size", str(p.tp)]
    if dcp > 1:
        argv += ["--dcp-size", str(dcp)]
        if facts.comm_backend != "auto":
            argv += ["--dcp-comm-backend", facts.comm_backend]
    argv += ["--page-size", str(c.block_size)]
    if facts.max_model_len:
        argv += ["--context-length", str(facts.max_model_len)]
    argv += ["--dtype", plan.model.dtype]
    gaps = []
    kv_dtype = SGLANG_KV_DTYPES.get(c.dtype)
    if kv_dtype is not None:
        argv += ["--kv-cache-dtype", kv_dtype]
    elif c.dtype != "auto":
        gaps.append(
            Gap(
                "cache.dtype",
                f"cache.dtype={c.dtype}: SGLang's --kv-cache-dtype takes auto, bfloat16, fp8_e4m3 or fp8_e5m2; "
                "not carried over",
                f"{SERVER_ARGS} (--kv-cache-dtype)",
            )
        )
    mem_args, mem_gaps = _memory(facts)
    argv += mem_args
    gaps += mem_gaps
    if not c.prefix_caching:
        argv.append("--disable-radix-cache")
    argv += ["--max-running-requests", str(s.max_num_seqs), "--max-prefill-tokens", str(s.max_num_batched_tokens)]
    argv += ["--chunked-prefill-size", str(s.max_num_batched_tokens if s.chunked_prefill else -1)]
    if plan.speculative_config.method is not None:
        gaps.append(
            Gap(
                "speculative_config",
                f"speculative_config (method {plan.speculative_config.method}) is not exported: SGLang's n-gram "
                "speculation (--speculative-algorithm NGRAM) takes other parameters",
                f"{SERVER_ARGS} (speculative decoding)",
            )
        )
    if facts.device == "cpu":
        argv += ["--device", "cpu"]
    if plan.launch.nnodes > 1:
        argv += ["--nnodes", str(plan.launch.nnodes), "--node-rank", str(plan.launch.node_rank)]
        argv += ["--dist-init-addr", f"{plan.launch.master_addr}:{plan.launch.master_port}"]
    argv += ["--host", plan.serve.host, "--port", str(port), "--served-model-name", plan.serve.model_name or plan.name]
    return argv, gaps


def sglang_export(facts: PlanFacts) -> Export:
    """The plan as SGLang launch lines; gaps for every rule it breaks and every field SGLang has no flag for."""
    plan = facts.plan
    gaps = uncarried_gaps(plan, CARRIED, "SGLang", SERVER_ARGS)
    if facts.prefill is None:
        layout, dcp, _ = _layout_gaps(facts, "")
        argv, more = launch_argv(facts, dcp, plan.serve.port)
        return Export("sglang", plan.name, facts.source, [Instance("serve", argv)], layout + gaps + more)
    gaps += [prefixed(g, "prefill") for g in uncarried_gaps(facts.prefill.plan, CARRIED, "SGLang", SERVER_ARGS)]
    ports = pd_ports(plan)
    gaps.append(
        Gap(
            "serve.port",
            f"SGLang's P/D router is a process of its own: python -m sglang_router.launch_router --pd-disaggregation "
            f"--prefill http://{plan.serve.host}:{ports['prefill']} {BOOTSTRAP_PORT} --decode "
            f"http://{plan.serve.host}:{ports['decode']} --port {plan.serve.port}",
            "SGLang docs/advanced_features/pd_disaggregation.md",
        )
    )
    instances = []
    for side, side_facts in (("prefill", facts.prefill), ("decode", facts)):
        layout, dcp, _ = _layout_gaps(side_facts, side)
        argv, more = launch_argv(side_facts, dcp, ports[side])
        argv += ["--disaggregation-mode", side, "--disaggregation-transfer-backend", plan.disagg.connector]
        if side == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
        instances.append(Instance(side, argv))
        gaps += layout + [prefixed(g, side) for g in more]
    return Export("sglang", plan.name, facts.source, instances, gaps)
