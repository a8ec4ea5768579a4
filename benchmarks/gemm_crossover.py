"""Where oneDNN overtakes the engine's panel GEMM: each CPU GEMM at SmolLM2-135M's linear shapes and many row counts.

    python benchmarks/gemm_crossover.py [--dtypes float32 bfloat16] [--rows 16 256 2048] [--repeats 5] [--layers 30]
    DCPCTL_CPU_ISA=avx2 python benchmarks/gemm_crossover.py     # what an AVX2-only CPU runs
    python benchmarks/gemm_crossover.py --dtypes bfloat16 --rows 3 4 8 16 32 64 128 256 512   # DCPCTL_BF16_GEMM

Per dtype, shape (qkv, o, gate_up, down, LM head) and row count: the best of `--repeats` rounds, after a warm-up, of
the engine's panel GEMM, oneDNN's packed linear (where it packs the dtype here) and F.linear on the plain weight,
each round calling it once on each of `--layers` distinct weights of the shape (SmolLM2's 30 layers: as in a forward
pass, the weights then come from memory, not from the cache a single weight would stay in; the LM head has one);
prints ms per call and GFLOP/s, and per dtype the smallest row count from which oneDNN is faster at every larger
measured count and on every shape (the crossover `cpu_paths.PREFILL_MIN_ROWS` is set from). Threads as the engine
runs them (GOMP_CPU_AFFINITY binds them when given). Random weights: the speed does not depend on the values.
On a CPU with AVX512-BF16 the bfloat16 panels are the dot-product kernel (vdpbf16ps): the bfloat16 table is what
decides whether `DCPCTL_BF16_GEMM=panels` should be the default there (below 512 rows, where decode runs).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from engine.kernels.cpu_gemm import pack_weight, packed_linear, packing_available
from engine.kernels.cpu_isa import detect
from engine.kernels.cpu_kernels import cpu_kernels_available, loaded_build, pack_panels, panel_linear
from engine.kernels.cpu_paths import gemm_name

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64 dims, intermediate 1536, vocabulary 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_ms(calls: list, repeats: int) -> float:
    """Best wall time of `repeats` rounds of `calls` (one after the other) after one warm-up round, in ms per call."""
    best = float("inf")
    for round_ in range(repeats + 1):
        start = time.perf_counter()
        for call in calls:
            call()
        if round_:
            best = min(best, time.perf_counter() - start)
    return best * 1e3 / len(calls)


def measure(
    dtype: torch.dtype, rows_list: list[int], repeats: int, layers: int
) -> dict[tuple[str, int], dict[str, float]]:
    """ms per call of each GEMM per (shape, rows), each call against the next of `layers` weights of the shape."""
    results = {}
    for shape, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k).to(dtype) for _ in range(1 if shape == "lm_head" else layers)]
        panels = [pack_panels(w) for w in weights]
        try:
            packed = [pack_weight(w) for w in weights] if packing_available() else None
        except RuntimeError:
            packed = None
        for rows in rows_list:
            if shape == "lm_head" and rows > 256:
                continue  # the LM head only sees the last token of each prompt
            x = torch.randn(rows, k).to(dtype)
            times = {
                "panels": best_ms([functools.partial(panel_linear, x, p, (n, k)) for p in panels], repeats),
                "F.linear": best_ms([functools.partial(F.linear, x, w) for w in weights], repeats),
            }
            if packed is not None:
                times["onednn"] = best_ms([functools.partial(packed_linear, x, p) for p in packed], repeats)
            results[shape, rows] = times
    return results


def crossover(results: dict[tuple[str, int], dict[str, float]], rows_list: list[int]) -> int | None:
    """The smallest row count from which oneDNN beats the panel GEMM on every shape at it and every larger count."""
    found = None
    for rows in sorted(rows_list, reverse=True):
        cells = [t for (_, r), t in results.items() if r == rows]
        if not cells or any("onednn" not in t or t["onednn"] >= t["panels"] for t in cells):
            break
        found = rows
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30, help="distinct weights per shape, called in turn")
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the engine's CPU kernels are not available here; nothing to compare")
    isa = detect()
    print(f"CPU ISA {isa.describe()}; {loaded_build()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.dtypes:
        results = measure(getattr(torch, name), args.rows, args.repeats, args.layers)
        print(f"\n{name}: ms per call (GFLOP/s); panels = {gemm_name('panels', isa, name)}")
        print("| shape | rows | panels | oneDNN packed | F.linear |\n|---|---:|---:|---:|---:|")
        for (shape, rows), times in results.items():
            flops = 2 * rows * SHAPES[shape][0] * SHAPES[shape][1]
            cells = [
                f"{times[g]:.3f} ({flops / times[g] / 1e6:.0f})" if g in times else "-"
                for g in ("panels", "onednn", "F.linear")
            ]
            print(f"| {shape} | {rows} | {' | '.join(cells)} |")
        print(f"{name}: oneDNN faster on every shape from {crossover(results, args.rows)} rows on")


if __name__ == "__main__":
    main()
