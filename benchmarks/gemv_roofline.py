"""Batch-1 decode ceiling: the model's chain of matmuls alone, against the memory's read bandwidth.

At batch 1 every decode step reads every weight once, so no engine can beat (weight bytes / read
bandwidth); the matmul kernels set a lower ceiling of their own. This runs the model's linear
layers (the shapes of a Llama-family config: qkv, o, gate_up, down per layer, then the LM head)
back to back on one row, through plain `F.linear`, oneDNN's packed path and the engine's own GEMV
(engine/kernels/cpu_gemm.py, cpu_kernels.py; the engine takes the GEMV at 1-2 rows), with random
weights of the model's dtype. It prints the read bandwidth, each chain's matmul time and effective
GB/s, and the tokens/s the engine's GEMV allows with nothing else in the step. With a gap, each
matmul follows that much single-threaded work, as in a real step; the matmuls alone are still
timed. Compare with `decode_throughput.py` for what the whole engine reaches.

    python benchmarks/gemv_roofline.py [--model smollm2-135m-instruct] [--dtypes float32 bfloat16]
        [--gaps-us 0 300] [--repeats 10]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels.cpu_gemm import pack_weight, packed_linear
from engine.kernels.cpu_kernels import cpu_kernels_available, gemv

KERNELS = ("F.linear", "packed", "gemv")


def read_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Measured read bandwidth (a sum over a large, touched tensor), in GB/s."""
    data = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def linear_shapes(folder: Path) -> list[tuple[int, int]]:
    """(out, in) of every matmul in one decode step of a Llama-family model, in execution order."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    if cfg.model_type not in ("llama", "mistral", "qwen2"):
        raise SystemExit(f"error: model_type {cfg.model_type!r} is not Llama-family (llama, mistral, qwen2)")
    hidden, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    layer = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * cfg.intermediate_size, hidden),
        (hidden, cfg.intermediate_size),
    ]
    return layer * cfg.num_hidden_layers + [(cfg.vocab_size, hidden)]


def chain_seconds(shapes: list[tuple[int, int]], dtype: torch.dtype, kernel: str, gap_us: float, repeats: int) -> float:
    """Best summed matmul time of one pass over all the matmuls at batch 1 (weights too big to stay in cache).

    `gap_us` > 0 runs that long of small single-threaded tensor work before each matmul (as the
    norms, rope and attention of a real step do) and still times the matmuls alone.
    """
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=g).to(dtype) for out, inp in shapes]
    inputs = {inp: torch.randn(1, inp, generator=g).to(dtype) for _, inp in shapes}
    if kernel == "packed":
        packs = [pack_weight(w) for w in weights]
        steps = [(lambda x, p=p: packed_linear(x, p)) for p in packs]
    else:
        matmul = F.linear if kernel == "F.linear" else gemv
        steps = [(lambda x, w=w: matmul(x, w)) for w in weights]
    scratch = torch.zeros(1, 64)

    def chain() -> float:
        total = 0.0
        for w, step in zip(weights, steps, strict=True):
            if gap_us:
                _busy(scratch, gap_us)
            x = inputs[w.shape[1]]
            start = time.perf_counter()
            step(x)
            total += time.perf_counter() - start
        return total

    chain()
    return min(chain() for _ in range(repeats))


def _busy(scratch: torch.Tensor, microseconds: float) -> None:
    end = time.perf_counter() + microseconds / 1e6
    while time.perf_counter() < end:
        scratch.add_(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--gaps-us", type=float, nargs="+", default=[0.0, 300.0], help="single-threaded work before each matmul"
    )
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("error: the engine's CPU kernels did not build here (see the warning above)")

    from engine.checkpoints.aliases import is_alias
    from engine.checkpoints.pull import pull_model

    folder = pull_model(args.model) if is_alias(args.model) else Path(args.model)
    shapes = linear_shapes(folder)
    bandwidth = read_bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, read bandwidth {bandwidth:.1f} GB/s, {len(shapes)} matmuls per step")
    columns = ["dtype", "weights MB", "read-bound tok/s", "gap us", *(f"{k} ms (GB/s)" for k in KERNELS)]
    columns.append("gemv ceiling tok/s")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    with torch.inference_mode():
        for name in args.dtypes:
            dtype = getattr(torch, name)
            nbytes = sum(out * inp for out, inp in shapes) * dtype.itemsize
            for gap in args.gaps_us:
                times = [chain_seconds(shapes, dtype, kernel, gap, args.repeats) for kernel in KERNELS]
                cells = " | ".join(f"{t * 1e3:.1f} ({nbytes / t / 1e9:.1f})" for t in times)
                print(
                    f"| {name} | {nbytes / 1e6:.0f} | {bandwidth * 1e9 / nbytes:.1f} | {gap:.0f} | {cells} "
                    f"| {1 / times[-1]:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
