"""The CPU decode attention kernel alone (`cpu_kernels.paged_decode`), one decode step of every layer, without a model.

    GOMP_CPU_AFFINITY="0 1" .venv/bin/python benchmarks/cpu_decode_attention.py [--dtypes float32 bfloat16]
        [--batch 16] [--context 192] [--layers 30] [--block 64] [--heads 9] [--kv-heads 3] [--dim 64] [--l3]
        [--dtypes float32 bfloat16 fp8_e4m3 fp8_e5m2 --query-dtype float32]

SmolLM2-135M's shape by default: 30 layers, 9 query / 3 KV heads of 64 dims, block 64, a head-major cache allocated
as the engine allocates it (`kv_cache.allocate`, the CPU backend's layout), random contents, each sequence's blocks
drawn at random from the pool. A step is one `paged_decode` call per layer; each figure is the best of `--repeats`
steps, after one warm-up step, and the KV bytes read per second at that time. `--l3`: every layer reads layer 0's
cache (4.7 MB in fp32 at the defaults), so the KV stays in L3 and the figure is the kernel's compute alone.
A `--dtypes` entry is the cache's dtype (a plan's `cache.dtype` name); the queries are in it too, except for an fp8
cache, whose queries are in `--query-dtype` (float32 by default), as a plan's model dtype. Prints one JSON line per
dtype.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine import kv_quant
from engine.attention import kv_cache
from engine.kernels import cpu_isa, cpu_kernels


def step_ms(args: argparse.Namespace, dtype: torch.dtype, query_dtype: torch.dtype) -> dict[str, float | str]:
    """Best-of-`repeats` time of one decode step's attention over all layers, and its KV read rate."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // args.block)
    blocks = args.batch * per_seq + 1
    storage, views = kv_cache.allocate(
        args.layers, blocks, args.block, args.kv_heads, args.dim, False, dtype, torch.device("cpu"), True
    )
    storage.copy_(torch.randn(storage.shape, generator=g).to(dtype))
    tables = torch.randperm(blocks, generator=g)[: args.batch * per_seq].view(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context, dtype=torch.long)
    q = torch.randn(args.batch, args.heads, args.dim, generator=g).to(query_dtype)
    layers = [views[0]] * args.layers if args.l3 else views
    scale = args.dim**-0.5

    def step() -> None:
        for keys, values in layers:
            cpu_kernels.paged_decode(q, keys, values, tables, lens, scale, args.dim)

    step()
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    kv_bytes = 2 * args.layers * args.batch * args.context * args.kv_heads * args.dim * dtype.itemsize
    name = kv_quant.dtype_name(dtype)
    return {
        "dtype": name,
        "query_dtype": str(query_dtype).removeprefix("torch."),
        "step_ms": round(best * 1e3, 3),
        "kv_gb_s": round(kv_bytes / best / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--query-dtype", default="float32", help="the queries' dtype against an fp8 cache")
    parser.add_argument("--l3", action="store_true", help="all layers read layer 0's cache (the KV stays in L3)")
    args = parser.parse_args()
    assert cpu_kernels.cpu_kernels_available(), "the CPU kernels did not build"
    build = cpu_kernels.loaded_build()
    print(json.dumps({"isa": cpu_isa.detect().describe(), "build": build, "threads": torch.get_num_threads()}))
    for name in args.dtypes:
        dtype = kv_quant.FP8_DTYPES.get(name) or getattr(torch, name)
        query = getattr(torch, args.query_dtype) if kv_quant.is_fp8(dtype) else dtype
        print(json.dumps(step_ms(args, dtype, query) | {"l3": args.l3}))


if __name__ == "__main__":
    main()
