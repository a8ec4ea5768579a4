"""Decode-attention bandwidth: KV bytes read per second, against the GPU's HBM peak, for each backend.

    python benchmarks/attention_bench.py                    # CUDA: the full grid (GQA 8:1 d128, MLA 576/512)
    python benchmarks/attention_bench.py --device cpu --tiny  # a smoke run in the Triton interpreter

Each case is one decode step of `batch` sequences of `context` tokens (one query token each) through the
backend's `paged()` (the per-step `prepare()` is outside the timing: it is shared by every layer). "dcp shard 1/2"
simulates a DCP rank's local shard: the local lengths are halved, so the kernel reads half the KV. Bytes read are
the KV cache bytes a kernel must touch (GQA: keys and values; MLA: the latent+rope key, values are inside it).
Writes a markdown table (and JSON) to --out (default: $OUT if set, else stdout only).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import kv_cache
from engine.attention.backend import AttentionMetadata, PagedKV
from engine.attention.registry import create_backend
from engine.errors import UserError

PEAK_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}  # HBM peak, TB/s (10^12 bytes per second)


@dataclass(frozen=True)
class Model:
    name: str
    heads: int
    kv_heads: int
    key_dim: int
    value_dim: int
    block_size: int
    mla: bool


FULL_MODELS = [
    # GQA 8:1 (e.g. Llama-3-70B's 64/8 at tp2); block 256 so flash-attn's paged KV can run the same cache
    Model("gqa8 32q/4kv d128", 32, 4, 128, 128, 256, False),
    # MLA (DeepSeek-V2/V3): 16 local heads (128 heads / tp8), one latent head of 512 + 64 rope dims
    Model("mla 16q 576/512", 16, 1, 576, 512, 64, True),
]
TINY_MODELS = [
    Model("gqa2 4q/2kv d16", 4, 2, 16, 16, 16, False),
    Model("mla 4q 40/32", 4, 1, 40, 32, 16, True),
]


@dataclass
class Result:
    model: str
    backend: str
    batch: int
    context: int
    shard: int
    local_len: int
    kv_bytes: int
    time_us: float | None
    gbs: float | None
    pct_peak: float | None
    note: str = ""


def kv_bytes(model: Model, batch: int, local_len: int, elem: int) -> int:
    per_token = model.kv_heads * (model.key_dim if model.mla else model.key_dim + model.value_dim)
    return batch * local_len * per_token * elem


def build_case(model: Model, batch: int, local_len: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Random caches with distinct, shuffled blocks per sequence (no two sequences share a block: no L2 reuse)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = model.block_size
    per_seq = -(-local_len // bs)
    blocks = batch * per_seq
    kc = torch.randn(blocks, bs, model.kv_heads, model.key_dim, device=device, dtype=dtype, generator=gen)
    vc = None
    if not model.mla:
        vc = torch.randn(blocks, bs, model.kv_heads, model.value_dim, device=device, dtype=dtype, generator=gen)
    tables = torch.randperm(blocks, device=device, generator=gen).view(batch, per_seq)
    q = torch.randn(batch, model.heads, model.key_dim, device=device, dtype=dtype, generator=gen)
    kv = PagedKV(
        block_tables=tables,
        lens=torch.full((batch,), local_len, dtype=torch.int64, device=device),
        query_start=torch.arange(batch + 1, dtype=torch.int64, device=device),
        query_counts=[1] * batch,
        local_lens=[local_len] * batch,
        max_len=local_len,
        block_size=bs,
    )
    return q, kc, vc, kv


def in_backend_layout(backend, kc: torch.Tensor, vc: torch.Tensor | None):
    """The case's caches as the engine would store them for `backend` (a copy only for a head-major backend)."""
    if not getattr(backend, "head_major_cache", False):
        return kc, vc
    blocks, block_size, kv_heads, key_dim = kc.shape
    _, [(keys, values)] = kv_cache.allocate(
        1, blocks, block_size, kv_heads, key_dim, vc is None, kc.dtype, kc.device, head_major=True
    )
    keys.copy_(kc)
    if values is not None:
        values.copy_(vc)
    return keys, values


def prepared(backend, kv: PagedKV, device: str) -> PagedKV:
    md = AttentionMetadata(
        backend=backend,
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        num_prefill_tokens=0,
        num_decode_tokens=kv.lens.numel(),
        decode=replace(kv, extra={}),
    )
    backend.prepare(md)
    return md.decode


def time_call(fn, device: str, reps: int) -> float:
    """Seconds per call: triton's do_bench (median, L2 flushed between calls) on CUDA, a plain loop on CPU."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=reps * 10, return_mode="median") / 1e3
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def peak_tbs(device: str, override: float | None) -> float | None:
    if override:
        return override
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TBS.items() if k in name), None)


def measure(name: str, backend, model: Model, case, args, reference) -> tuple[float | None, str, object]:
    """(seconds per call or None, note, output) of one backend on one case."""
    q, kc, vc, kv = case
    if name == "flash_attn" and model.mla:
        return None, "MLA: uses the Triton kernels", reference
    nbytes = kv_bytes(model, kv.lens.numel(), kv.max_len, kc.element_size())
    if name == "torch" and nbytes > args.torch_max_gib * 2**30:
        return None, f"skipped: KV > {args.torch_max_gib:g} GiB", reference
    pkv = prepared(backend, kv, args.device)
    kc, vc = in_backend_layout(backend, kc, vc)
    scale = model.key_dim**-0.5

    def call():
        return backend.paged(q, kc, vc, model.value_dim, pkv, scale)

    try:
        out = call()
        seconds = time_call(call, args.device, args.reps)
    except (torch.OutOfMemoryError, UserError) as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:60]}", reference
    if reference is None:
        return seconds, "", out
    diff = (out[0].float() - reference[0].float()).abs().max().item()
    return seconds, ("" if diff < 5e-2 else f"MISMATCH vs {args.backends[0]}: {diff:.3g}"), reference


def run(args) -> list[Result]:
    device = args.device
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    elem = torch.empty(0, dtype=dtype).element_size()
    peak = peak_tbs(device, args.peak_tbs)
    backends = {}
    for name in args.backends:
        try:
            backends[name] = create_backend(name)
        except UserError as exc:
            print(f"note: backend {name} skipped: {exc}", file=sys.stderr)
    results: list[Result] = []
    for model in TINY_MODELS if args.tiny else FULL_MODELS:
        for context in args.contexts:
            for batch in args.batches:
                for shard in args.shards:
                    local = context // shard
                    nbytes = kv_bytes(model, batch, local, elem)
                    row = {"model": model.name, "batch": batch, "context": context, "shard": shard,
                           "local_len": local, "kv_bytes": nbytes}  # fmt: skip
                    try:
                        case = build_case(model, batch, local, dtype, device)
                    except torch.OutOfMemoryError:
                        results.append(Result(**row, backend="-", time_us=None, tbs=None, pct_peak=None,
                                              note="cache does not fit"))  # fmt: skip
                        continue
                    reference = None
                    for name, backend in backends.items():
                        seconds, note, reference = measure(name, backend, model, case, args, reference)
                        gbs = nbytes / seconds / 1e9 if seconds else None
                        pct = 100 * gbs / (peak * 1e3) if gbs and peak else None
                        results.append(Result(**row, backend=name, time_us=seconds and seconds * 1e6, gbs=gbs,
                                              pct_peak=pct, note=note))  # fmt: skip
                        speed = f"{seconds * 1e6:10.1f} us {gbs:8.1f} GB/s" if seconds else ""
                        print(f"{model.name:20s} {name:10s} b{batch:<3d} ctx {context:>7d} 1/{shard} {speed} {note}",
                              file=sys.stderr, flush=True)  # fmt: skip
                    del case, reference
                    if device == "cuda":
                        torch.cuda.empty_cache()
        save(results, markdown(results, args, peak), args)  # a run cut short keeps what it measured
    return results


SWEEP = {  # (BLOCK_M, BLOCK_N, warps, stages)
    "gqa": [(16, 32, 4, 2), (16, 64, 4, 2), (16, 128, 4, 2), (16, 64, 8, 3), (16, 128, 8, 3), (16, 32, 4, 4)],
    "mla": [(16, 16, 8, 2), (16, 32, 4, 2), (16, 32, 8, 3), (16, 64, 8, 2)],
}


def sweep(args) -> None:
    """Tile configurations of the Triton decode kernel at the longest context and the middle batch, one markdown
    row printed as each is measured (a run cut short keeps its rows): the data for tuning the defaults."""
    from engine.attention import triton_kernels as tk

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    peak = peak_tbs(args.device, args.peak_tbs)
    print("## Triton decode tile sweep\n")
    print("| model | batch | local len | BLOCK_M | BLOCK_N | warps | stages | us | GB/s | % peak | default |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    context = max(args.contexts)
    batch = sorted(args.batches)[len(args.batches) // 2]
    for model in TINY_MODELS if args.tiny else FULL_MODELS:
        q, kc, vc, kv = build_case(model, batch, context, dtype, args.device)
        nbytes = kv_bytes(model, batch, context, kc.element_size())
        default = tk.default_paged_config(model.key_dim, 1, model.heads // model.kv_heads, args.device != "cuda")
        configs = [tk.PagedConfig(*c) for c in SWEEP["mla" if model.mla else "gqa"]]
        configs = [default] + [c for c in configs if c != default]
        for cfg in configs if args.device == "cuda" else configs[:2]:
            call = functools.partial(tk.paged_attention, q, kc, vc, model.value_dim, kv.block_tables, kv.lens,
                                     kv.query_start, 1, kv.max_len, model.key_dim**-0.5, config=cfg)  # fmt: skip
            cells = f"| {model.name} | {batch} | {context} | {cfg.block_m} | {cfg.block_n} | {cfg.num_warps} | "
            cells += f"{cfg.num_stages} | "
            try:
                call()
                seconds = time_call(call, args.device, args.reps)
            except Exception as exc:  # a config that does not compile or fit is a data point, not a failure
                print(cells + f"{type(exc).__name__} | | | |", flush=True)
                continue
            gbs = nbytes / seconds / 1e9
            pct = f"{100 * gbs / (peak * 1e3):.0f}" if peak else "-"
            mark = "yes" if cfg == default else ""
            print(cells + f"{seconds * 1e6:.1f} | {gbs:.1f} | {pct} | {mark} |", flush=True)
        q = kc = vc = kv = None  # free the cache before the next model
        if args.device == "cuda":
            torch.cuda.empty_cache()


def markdown(results: list[Result], args, peak: float | None) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter: not a speed figure)"
    lines = [
        f"## Decode attention bandwidth ({device}, {args.dtype})",
        "",
        f"KV bytes read / time; HBM peak {peak} TB/s." if peak else "KV bytes read / time (no peak for this device).",
        "One query token per sequence; `shard 1/2` = a DCP rank's local shard (half the tokens).",
        "",
    ]
    backends = [b for b in args.backends if any(r.backend == b for r in results)]
    head = "| model | batch | context | shard | KV MiB |" + "".join(f" {b} us | {b} GB/s | {b} % |" for b in backends)
    lines += [head, "|" + "---|" * (5 + 3 * len(backends))]
    rows: dict[tuple, dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.model, r.batch, r.context, r.shard, r.kv_bytes), {})[r.backend] = r
    for (model, batch, context, shard, nbytes), by in rows.items():
        cells = [model, str(batch), str(context), f"1/{shard}", f"{nbytes / 2**20:.2f}"]
        for b in backends:
            r = by.get(b)
            if r is None or r.time_us is None:
                cells += [r.note if r else "-", "", ""]
            else:
                pct = f"{r.pct_peak:.0f}" if r.pct_peak is not None else "-"
                cells += [f"{r.time_us:.1f}", f"{r.gbs:.1f}", pct + (f" {r.note}" if r.note else "")]
        lines.append("| " + " | ".join(cells) + " |")
    long = [r for r in results if r.backend == "triton" and r.pct_peak is not None and r.local_len >= 32768]
    if long:
        best = max(long, key=lambda r: r.pct_peak)
        lines += ["", f"Triton at local length >= 32k: best {best.pct_peak:.0f}% of peak ({best.model}, batch "
                      f"{best.batch}, context {best.context}, shard 1/{best.shard}); aim >= 70%."]  # fmt: skip
    return "\n".join(lines) + "\n"


def save(results: list[Result], text: str, args) -> None:
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention_bench.md").write_text(text)
        (out / "attention_bench.json").write_text(json.dumps([asdict(r) for r in results], indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run in the interpreter)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backends", default="triton,flash_attn,torch")
    parser.add_argument("--contexts", default=None, help="comma-separated global context lengths")
    parser.add_argument("--batches", default=None)
    parser.add_argument("--shards", default="1,2", help="1 = dcp 1; 2 = a DCP rank's half of the tokens")
    parser.add_argument("--reps", type=int, default=None, help="CUDA: ~ms of timing per case / 10; CPU: calls")
    parser.add_argument("--torch-max-gib", type=float, default=8.0, help="skip the torch gather above this KV size")
    parser.add_argument("--peak-tbs", type=float, default=None)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for attention_bench.md/.json")
    parser.add_argument("--sweep", action="store_true", help="instead: Triton tile configs (markdown on stdout)")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    tiny_contexts, full_contexts = "64,200", "4096,16384,65536,131072"
    args.contexts = [int(x) for x in (args.contexts or (tiny_contexts if args.tiny else full_contexts)).split(",")]
    args.batches = [int(x) for x in (args.batches or ("1,2" if args.tiny else "1,8,32,64")).split(",")]
    args.shards = [int(x) for x in args.shards.split(",")]
    args.reps = args.reps or (2 if args.device == "cpu" else 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    if args.device == "cpu" and "flash_attn" in args.backends:
        args.backends.remove("flash_attn")
    if args.sweep:
        sweep(args)
        return 0
    results = run(args)
    text = markdown(results, args, peak_tbs(args.device, args.peak_tbs))
    print(text)
    save(results, text, args)
    mismatches = [r for r in results if "MISMATCH" in r.note]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
