"""Prefill attention of the new tokens on CPU, per layer: the torch backend's path against `cpu_kernels.prefill_causal`.

    GOMP_CPU_AFFINITY="0 1" .venv/bin/python benchmarks/cpu_prefill_attention.py [--shapes 16x128 4x512 1x1024]
        [--dtypes float32 bfloat16] [--heads 9] [--kv-heads 3] [--dim 64] [--repeats 20] [--products auto fp32]

SmolLM2-135M's heads by default (9 query / 3 KV heads of 64 dims). A shape PxN is P prompts of N tokens in one
prefill step. The inputs are what a layer hands `prefill_new`: q and k contiguous (rotary's outputs), v a strided
slice of one [T, Hq + 2 Hkv, D] projection. `old` is `TorchBackend.prefill_new` (a CPU flash call per prompt, K/V
repeated for GQA), `new` the kernel; they alternate call by call, one warm-up each, and each figure is the best (and
median) of `--repeats` calls, in ms per layer. Prints one JSON line per shape and dtype. `--products` times the
kernel's bf16 paths side by side (`cpu_kernels.prefill_bf16_products()`: amx, avx512_bf16, fp32; `auto` is `new`),
each as `<name>_ms` with its speedup over `old`; float32 runs `auto` only.

    GOMP_CPU_AFFINITY="0 1" .venv/bin/python benchmarks/cpu_prefill_attention.py --model [--torch-prefill]
        [--prompts 16] [--prompt-len 128] [--dtype float32] [--repeats 5]

`--model`: the whole prefill instead, SmolLM2-135M-Instruct (plans/cpu/smollm2_tp1_dcp1.yaml) prefilling `--prompts`
seeded random prompts of `--prompt-len` tokens in one step (`LLM.generate`, 1 greedy new token), best of `--repeats`
after a warm-up; `--torch-prefill` runs the torch backend's prefill attention (the path before the kernel) instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine.attention.backend import PrefillNew
from engine.attention.torch_backend import TorchBackend
from engine.kernels import cpu_isa, cpu_kernels


def inputs(
    prompts: int, tokens: int, args: argparse.Namespace, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefillNew]:
    """q [T, H, D], k [T, Hkv, D] contiguous and v [T, Hkv, D] a slice of a qkv projection, with the step's prompts."""
    g = torch.Generator().manual_seed(0)
    total = prompts * tokens
    qkv = torch.randn(total, args.heads + 2 * args.kv_heads, args.dim, generator=g).to(dtype)
    q, k = qkv[:, : args.heads].contiguous(), qkv[:, args.heads : args.heads + args.kv_heads].contiguous()
    cu = torch.arange(prompts + 1, dtype=torch.long) * tokens
    return q, k, qkv[:, args.heads + args.kv_heads :], PrefillNew(cu, [tokens] * prompts, tokens)


def compare(prompts: int, tokens: int, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, float | str]:
    """Old and new per-layer times (ms), alternating, and each new output's largest difference from the old."""
    q, k, v, prefill = inputs(prompts, tokens, args, dtype)
    scale = args.dim**-0.5
    backend = TorchBackend()
    paths: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor | None]]] = {
        "old": lambda: backend.prefill_new(q, k, v, prefill, scale, True)
    }
    for products in args.products if dtype == torch.bfloat16 else ["auto"]:
        name = "new" if products == "auto" else products
        paths[name] = lambda p=products: cpu_kernels.prefill_causal(q, k, v, prefill.cu_seqlens, scale, products=p)
    outs = {name: run() for name, run in paths.items()}  # the warm-up
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    old = min(times["old"])
    result: dict[str, float | str] = {
        "shape": f"{prompts}x{tokens}",
        "dtype": str(dtype).removeprefix("torch."),
        "old_ms": round(old, 3),
        "old_median_ms": round(statistics.median(times["old"]), 3),
    }
    for name in list(paths)[1:]:
        suffix = "" if name == "new" else f"_{name}"
        result[f"{name}_ms"] = round(min(times[name]), 3)
        result[f"{name}_median_ms"] = round(statistics.median(times[name]), 3)
        result[f"speedup{suffix}"] = round(old / min(times[name]), 2)
        result[f"max_out_diff{suffix}"] = (outs[name][0].float() - outs["old"][0].float()).abs().max().item()
        result[f"max_lse_diff{suffix}"] = (outs[name][1] - outs["old"][1]).abs().max().item()
    return result


def whole_prefill(args: argparse.Namespace) -> dict[str, float | str]:
    """Best-of-`repeats` seconds of one prefill step of the model (with the kernel, or the torch backend's path)."""
    from engine.attention.cpu_backend import CpuBackend
    from engine.core.sequence import SamplingParams
    from engine.llm import LLM

    if args.torch_prefill:
        CpuBackend.prefill_new = TorchBackend.prefill_new  # type: ignore[method-assign]
    llm = LLM("plans/cpu/smollm2_tp1_dcp1.yaml", [f"model.dtype={args.dtype}", "cache.prefix_caching=false"])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.prompts, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # the warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    path = "torch" if args.torch_prefill else "kernel"
    return {
        "prefill": f"{args.prompts}x{args.prompt_len}",
        "dtype": args.dtype,
        "attention": path,
        "best_s": round(min(times), 4),
        "median_s": round(statistics.median(times), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["16x128", "4x512", "1x1024"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--products", nargs="+", default=["auto"], help="bf16 kernel paths to time (auto: `new`)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls (--model: timed prefills, use ~5)")
    parser.add_argument("--model", action="store_true", help="time the whole model's prefill step instead")
    parser.add_argument("--torch-prefill", action="store_true", help="--model: the torch backend's prefill attention")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="--model: the model's dtype")
    args = parser.parse_args()
    assert cpu_kernels.cpu_kernels_available(), "the CPU kernels did not build"
    build = cpu_kernels.loaded_build()
    print(json.dumps({"isa": cpu_isa.detect().describe(), "build": build, "threads": torch.get_num_threads()}))
    if args.model:
        print(json.dumps(whole_prefill(args)))
        return
    for shape in args.shapes:
        prompts, tokens = (int(x) for x in shape.split("x"))
        for name in args.dtypes:
            print(json.dumps(compare(prompts, tokens, args, getattr(torch, name))))


if __name__ == "__main__":
    main()
