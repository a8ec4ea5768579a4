"""lm-eval's own HF transformers model (`hf`) on the gsm8k task `dcpctl eval gsm8k` runs: a reference column.

Runs lm-eval's `HFLM` (transformers `generate`, in this process) on the same task, data, few-shot
seed and limit as an earlier `dcpctl eval gsm8k --output DIR` run, then prints and writes the
comparison with that run: accuracy, per-question agreement of answers and of the full generated
text (did the engine reproduce HF's generations?), and both wall times.

    dcpctl eval gsm8k --compare plans/cpu/smollm2_tp1_dcp1.yaml --data-dir ../shared/data/gsm8k \\
        --limit 100 --output runs/eval100
    python benchmarks/eval_hf_reference.py runs/eval100/smollm2_tp1_dcp1/eval_run.json \\
        --data-dir ../shared/data/gsm8k --limit 100 --output runs/eval100_hf
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console

from engine.checkpoints.aliases import resolve_model_path
from evals.compare import compare_runs
from evals.lm_eval_runner import eval_run_from_lm_eval, evaluate_lm
from evals.report import render_table, write_report
from evals.results import EvalRun
from evals.tasks import gsm8k_task


def run_hf(model_path: Path, data_dir: Path, limit: int, num_fewshot: int, batch_size: int, dtype: str) -> EvalRun:
    """gsm8k through lm-eval's `hf` model on the CPU; wall time counts the evaluation, not the model load."""
    from lm_eval.models.huggingface import HFLM

    with tempfile.TemporaryDirectory(prefix="dcpctl-hf-eval-") as work:
        task = gsm8k_task(data_dir, Path(work))
        lm = HFLM(pretrained=str(model_path), dtype=dtype, batch_size=batch_size, device="cpu")
        output, wall_s = evaluate_lm(lm, task, limit=limit, num_fewshot=num_fewshot)
    return eval_run_from_lm_eval(
        output,
        task.name,
        label=f"hf-transformers (lm-eval hf, batch {batch_size})",
        dataset=task.display_name,
        wall_s=wall_s,
        model=str(model_path),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_run", type=Path, help="eval_run.json of a plan from `dcpctl eval --output DIR`")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--num-fewshot", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="HF folder or alias (default: SmolLM2)")
    parser.add_argument("--output", type=Path, help="write comparison.json/.md, accuracy.png and samples here")
    args = parser.parse_args()

    engine = EvalRun.from_dict(json.loads(args.engine_run.read_text())["run"])
    model_path = resolve_model_path(args.model)
    hf = run_hf(model_path, args.data_dir, args.limit, args.num_fewshot, args.batch_size, args.dtype)
    comparison = compare_runs([engine, hf])
    Console(width=160).print(render_table(comparison))
    if args.output is not None:
        write_report(comparison, args.output)


if __name__ == "__main__":
    main()
