"""`plan suggest`'s predictions against a `dcpctl bench` run: decode step time and KV token capacity per plan.

    dcpctl bench plans/cpu/smollm2_*.yaml --input-len 512 --output-len 128 --num-prompts 16 --concurrency 8 \\
        --output runs/suggest_bench
    python benchmarks/suggest_vs_bench.py runs/suggest_bench/bench.json [--remeasure]

Each plan's roofline step (engine.suggest.suggest.plan_step) is predicted at the batch the bench's inter-token gaps
were decoded at (the roofline's batch: requests decoding at each gap's end, averaged over the gaps) and its mean
context (input + output / 2), with the `cpu` figures measured on this machine
(--remeasure: now, right after the bench, under the same load). Measured: the bench's ITL p50 (one decode step)
and the blocks the server allocated x block size x dcp. Prints a markdown table for docs/results/suggest.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.plan.checks import validate_plan_file
from engine.suggest.figures import Cluster
from engine.suggest.hardware import cpu
from engine.suggest.suggest import plan_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--remeasure", action="store_true", help="measure the CPU figures now")
    args = parser.parse_args()
    report = json.loads(args.bench_json.read_text())
    plans = [t for t in report["targets"] if t["kind"] == "plan" and not t["error"] and t["roofline"]]
    checks = [validate_plan_file(t["spec"]) for t in plans]
    models = {check.require_valid().model.path for check in checks}
    if len(models) != 1:
        raise SystemExit(f"the bench's plans run {len(models)} models; compare one model's plans at a time")
    spec = cpu(checks[0].resolved.model, args.remeasure)
    cluster = Cluster(spec, spec.devices_per_node, 1)
    print(
        f"cpu figures: copy bandwidth {spec.bandwidth / 1e9:.1f} GB/s; at the model's decode shapes, the engine's "
        f"linears {spec.flops32 / 1e9:.1f} GFLOP/s and decode attention {spec.attention_bandwidth / 1e9:.1f} GB/s of "
        f"KV ({spec.devices_per_node} cores, one thread each, side by side), one rank on all cores "
        f"{spec.single_rank_flops / 1e9:.1f} GFLOP/s and {spec.single_rank_attention_bandwidth / 1e9:.1f} GB/s; "
        f"host per layer {spec.layer_overhead_s * 1e3:.2f} ms "
        f"(dcp > 1: {spec.dcp_layer_overhead_s * 1e3:.2f} ms); serving {spec.serve_token_s * 1e3:.2f} ms per token; "
        f"collective {spec.link_latency_s * 1e3:.3f} ms inside "
        f"a two-rank step (gloo {spec.network_latency_s * 1e3:.3f} ms); "
        f"bench copy bandwidth {report['bandwidth_bytes_s'].get('cpu', 0) / 1e9:.1f} GB/s"
    )
    print()
    print(
        "| plan | batch | context | predicted step ms (max(weights, matmuls) / attention / comm / host / serving) "
        "| measured ITL p50 ms | measured / predicted | predicted capacity | allocated capacity |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for target, check in zip(plans, checks, strict=True):
        res = check.require_valid()
        roof = target["roofline"]
        context = round(roof["context_len"])
        step = plan_step(check, cluster, roof["batch"], context)
        measured = target["metrics"]["itl"]["p50"]
        allocated = target["num_blocks"] * res.plan.cache.block_size * res.plan.parallel.dcp
        weights = f"max({step.memory_s * 1e3:.1f}, {step.compute_s * 1e3:.1f})"
        rest = (step.attention_s, step.comm_s, step.overhead_s, step.serve_s)
        parts = " / ".join([weights, *(f"{x * 1e3:.1f}" for x in rest)])
        print(
            f"| {target['label']} | {roof['batch']:.1f} | {context} | {step.seconds * 1e3:.1f} ({parts}) "
            f"| {measured * 1e3:.1f} | {measured / step.seconds:.2f} | {res.kv.token_capacity:,} | {allocated:,} |"
        )


if __name__ == "__main__":
    main()
