"""Decode throughput of the engine vs HF transformers `generate`, side by side in one run.

SmolLM2-135M-Instruct, 128-token prompts, 128 forced new tokens (EOS ignored), batch 1 and 16,
float32 and bfloat16. Prints a markdown table of generated tokens/s and the engine/HF ratio, plus
the weight-read bound (weights bytes / measured copy bandwidth) for batch 1. HF runs in the same
process after the engine started, so it gets the engine's glibc allocator settings too
(engine/host_allocator.py): the ratio measures the model code, not the allocator.

    python benchmarks/decode_throughput.py [--batches 1 16] [--dtypes float32 bfloat16] [--repeats 2]
        [--backend auto]

The engine runs the plan's `attention.backend` (auto: the `cpu` backend on CPU). For the engine
without its own CPU kernels (torch's kernels throughout, as before they existed), run with
`DCPCTL_CPU_KERNELS=0 ... --backend torch`.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch
import yaml


def copy_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Measured memory bandwidth (read + write) of a large tensor copy, in GB/s."""
    src = torch.empty(size_mb * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(batch)]


def bench_engine(
    folder: Path, dtype: str, batch: int, prompt_len: int, new_tokens: int, repeats: int, backend: str
) -> float:
    from engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.yaml"
        plan.write_text(
            yaml.safe_dump(
                {
                    "model": {"path": str(folder), "dtype": dtype, "max_model_len": 1024},
                    "cache": {"block_size": 16, "memory": "512MiB", "prefix_caching": False},
                    "attention": {"backend": backend},
                    "launch": {"device": "cpu"},
                    "scheduler": {"max_num_seqs": max(batch, 1), "max_num_batched_tokens": 4096},
                }
            )
        )
        with LLM(plan) as llm:
            ids = prompts(batch, prompt_len, llm.engine.runner.vocab_size)
            params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
            llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                outputs = llm.generate(ids, params)
                best = min(best, time.perf_counter() - start)
            assert all(len(o.token_ids) == new_tokens for o in outputs)
    return batch * new_tokens / best


def bench_hf(folder: Path, dtype: str, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts(batch, prompt_len, model.config.vocab_size))
    kwargs = {
        "do_sample": False,
        "min_new_tokens": new_tokens,
        "max_new_tokens": new_tokens,
        "pad_token_id": model.config.eos_token_id,
    }
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            best = min(best, time.perf_counter() - start)
    del model
    gc.collect()
    return batch * new_tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="the engine's attention.backend")
    args = parser.parse_args()

    from engine.checkpoints.aliases import is_alias
    from engine.checkpoints.model_info import read_model_info
    from engine.checkpoints.pull import pull_model

    folder = pull_model(args.model) if is_alias(args.model) else Path(args.model)
    weights_gb = read_model_info(folder).weight_bytes / 1e9  # fp32 on disk
    bandwidth = copy_bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, copy bandwidth {bandwidth:.1f} GB/s, fp32 weights {weights_gb:.2f} GB")
    print("| dtype | batch | engine tok/s | HF tok/s | engine / HF | b1 bound tok/s | engine / bound |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        scale = 1.0 if dtype == "float32" else 0.5
        bound = bandwidth / (weights_gb * scale)
        for batch in args.batches:
            ours = bench_engine(folder, dtype, batch, args.prompt_len, args.new_tokens, args.repeats, args.backend)
            theirs = bench_hf(folder, dtype, batch, args.prompt_len, args.new_tokens, args.repeats)
            vs_bound = f"{ours / bound:.2f}" if batch == 1 else "-"
            print(
                f"| {dtype} | {batch} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {bound:.1f} | {vs_bound} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
