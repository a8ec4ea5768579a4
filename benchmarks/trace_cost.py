"""What the token traces of `dcpctl eval` cost: the same greedy workload with and without the logprobs that the
eval asks for (the top TOP_LOGPROBS alternatives of every generated token, named by id), on one server,
alternating, best of N; prints output tokens/s of both and their ratio.

    python benchmarks/trace_cost.py plans/cpu/smollm2_tp1_dcp1.yaml --num-prompts 16 --input-len 256 \\
        --output-len 64 --repeats 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.checkpoints.aliases import resolve_model_path
from engine.plan.checks import validate_plan_file
from evals.bench.client import run_requests
from evals.bench.workload import load_tokenizer, random_prompts, sampleable_ids
from evals.endpoint import served_model
from evals.launch import PlanServer
from evals.traces import completions_trace_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE plan overrides")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    resolved = validate_plan_file(args.plan, args.overrides).require_valid()
    tokenizer = load_tokenizer(resolve_model_path(resolved.plan.model.path))
    prompts = random_prompts(sampleable_ids(tokenizer), args.num_prompts, args.input_len, seed=0)
    best = {"plain": 0.0, "traced": 0.0}
    with PlanServer(args.plan, args.overrides) as server:
        model = served_model(server.base_url)
        run_requests(server.base_url, model, prompts[:2], 8, concurrency=2)  # warm-up
        for _ in range(args.repeats):
            for name, extra in (("plain", None), ("traced", completions_trace_request())):
                run = run_requests(
                    server.base_url, model, prompts, args.output_len, concurrency=len(prompts), extra_fields=extra
                )
                tokens = sum(r.output_tokens for r in run.records if r.error is None)
                best[name] = max(best[name], tokens / run.duration_s)
                print(f"{name}: {tokens / run.duration_s:.1f} output tok/s", flush=True)
    print(
        f"best of {args.repeats}: plain {best['plain']:.1f}, traced {best['traced']:.1f} output tok/s; "
        f"traced / plain = {best['traced'] / best['plain']:.3f}"
    )


if __name__ == "__main__":
    main()
