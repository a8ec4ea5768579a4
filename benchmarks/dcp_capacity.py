"""KV capacity and long-context decode time, dcp 1 vs dcp 2, side by side in one run.

On a tiny MLA model (DeepSeek-V2 shaped latent: kv_lora_rank 512 + rope 64) at a fixed KV budget
per rank, it reports the tokens that fit for tp2/dcp1 and tp2/dcp2 (both two ranks, gloo on CPU),
what each rank actually allocated, and the decode time per token at several context lengths,
measured through `dcpctl run` (prompt of L tokens, then N forced new tokens).

    python benchmarks/dcp_capacity.py [--contexts 4096 8192 16384] [--new-tokens 32] [--memory 64MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from engine.plan.checks import validate_plan_file
from engine.plan.kv_sizing import format_bytes


def make_model(folder: Path) -> Path:
    from engine.checkpoints.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(
        folder,
        "deepseek_v2",
        seed=0,
        overwrite=True,
        hidden_size=256,
        num_layers=2,
        num_heads=8,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=32768,
        n_routed_experts=0,
    )


def write_plan(folder: Path, model: Path, dcp: int, memory: str, max_len: int) -> Path:
    plan = folder / f"tp2_dcp{dcp}.yaml"
    plan.write_text(
        yaml.safe_dump(
            {
                "name": f"tp2_dcp{dcp}",
                "model": {"path": str(model), "max_model_len": max_len},
                "parallel": {"tp": 2, "dcp": dcp, "interleave": 1},
                "cache": {"block_size": 64, "memory": memory, "prefix_caching": False},
                "scheduler": {"max_num_batched_tokens": 1024},
                "attention": {"backend": "torch"},
                "launch": {"device": "cpu"},
            }
        )
    )
    return plan


def decode_time(plan: Path, context: int, new_tokens: int, work: Path) -> tuple[float, list[dict]]:
    """Seconds per decoded token for one sequence of `context` prompt tokens, and each rank's cache stats."""
    prompts = work / f"prompt{context}.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [3 + i % 400 for i in range(context)]}) + "\n")
    out, stats = work / "out.jsonl", work / f"stats-{plan.stem}-{context}"
    env = dict(os.environ, DCPCTL_RANK_STATS_DIR=str(stats))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dcpctl.cli",
            "run",
            str(plan),
            "--prompts-file",
            str(prompts),
            "--max-tokens",
            str(new_tokens),
            "--ignore-eos",
            "--output",
            str(out),
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    record = json.loads(out.read_text().splitlines()[0])
    per_token = (record["latency_s"] - record["ttft_s"]) / (new_tokens - 1)
    return per_token, [json.loads(p.read_text()) for p in sorted(stats.glob("*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--memory", default="64MiB", help="KV budget per rank (cache.memory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcp-capacity-") as tmp:
        work = Path(tmp)
        model = make_model(work / "model")
        max_len = max(args.contexts) + args.new_tokens
        plans, checks = {}, {}
        for d in (1, 2):
            plans[d] = write_plan(work, model, d, args.memory, max_len)
            checks[d] = validate_plan_file(plans[d])
            kv = checks[d].resolved.kv
            if kv is not None and kv.token_capacity < max_len:  # cap at what fits
                plans[d] = write_plan(work, model, d, args.memory, kv.token_capacity)
                checks[d] = validate_plan_file(plans[d])
        print(f"KV budget per rank: {args.memory}")
        print("| plan | KV bytes per rank | blocks per rank | tokens per rank | token capacity | vs dcp1 |")
        print("|---|---|---|---|---|---|")
        for c in checks.values():
            r = c.resolved
            if r.kv is None:
                raise SystemExit(f"{c.name}: {[str(e) for e in c.problems.errors]}")
            print(
                f"| {r.name} | {format_bytes(r.kv.bytes_per_rank)} | {r.kv.num_blocks} | {r.kv.tokens_per_rank} | "
                f"{r.kv.token_capacity} | {r.kv.token_capacity / checks[1].resolved.kv.token_capacity:.2f}x |"
            )
        print()
        print("| context | dcp1 ms/token | dcp2 ms/token | dcp2 / dcp1 |")
        print("|---|---|---|---|")
        for context in args.contexts:
            times = {}
            for d, plan in plans.items():
                if checks[d].resolved.kv.token_capacity < context + args.new_tokens:
                    times[d] = None
                    continue
                times[d], stats = decode_time(plan, context, args.new_tokens, work)
                assert {s["kv_cache_bytes"] for s in stats} == {checks[d].resolved.kv.bytes_per_rank}
            cells = [f"{t * 1e3:.1f}" if t else "does not fit" for t in (times[1], times[2])]
            ratio = f"{times[2] / times[1]:.2f}" if times[1] and times[2] else "-"
            print(f"| {context} | {cells[0]} | {cells[1]} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
