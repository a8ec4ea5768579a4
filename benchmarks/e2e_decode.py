"""Whole-engine decode at real model shapes on one GPU: tokens/s against the HBM roofline, CUDA graphs on and off.

    python benchmarks/e2e_decode.py --model llama-3.1-8b-instruct      # CUDA: bf16, batch 1/8/64, input 2k/32k
    python benchmarks/e2e_decode.py --model deepseek-v2-lite --tiny    # a CPU smoke run at test size

The checkpoint is random (`dcpctl model random`, generated here, on the GPU, then deleted unless --keep): the speed
of real shapes needs no real weights. One rank (tp 1, dcp 1) runs the engine's model runner in this process with the
plan's Triton backend. Each case is `batch` sequences whose first `input` tokens are already in the KV cache (their
values are the cache's zeros: a decode step reads every one of them all the same, and no prefill is timed); a step is
the runner's `execute` (inputs, forward pass, LM head) plus the greedy argmax copied to the host, as the sampler does.
"graphs" replays the step's captured CUDA graph (model.enforce_eager false); "eager" runs the same runner with its
graphs set aside. A case whose KV cache does not fit next to the weights is reported as such.

Roofline: the bytes a step must read from HBM over its peak bandwidth. Bytes = every weight except the embedding
table (a step reads B of its rows), but of each MoE layer's routed experts only those the batch can reach: E * (1 -
(1 - k/E)^B) of E under uniform routing (random weights route about uniformly); plus the cached KV of every sequence.
Fraction = roofline seconds / measured seconds. Also: greedy tokens with graphs on equal to off (16 steps after a
real prefill of 4 prompts), and for MoE models the fused experts against the per-expert loop at 1/8/64 tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_bench import peak_tbs
from engine.checkpoints.random_model import make_random_checkpoint
from engine.core.startup import start_rank
from engine.plan.checks import resolve_plan
from engine.runtime.step import ScheduledChunk, ScheduledStep

BLOCK_SIZE = 64
GREEDY_PROMPTS = (5, 33, 70, 128)  # prompt lengths of the graphs-on-equals-off check
GREEDY_NEW = 16
GREEDY_LEN = max(GREEDY_PROMPTS) + GREEDY_NEW
TINY = {  # test-size versions of the named models' architectures (the CPU smoke run)
    "deepseek-v2-lite": {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 1024,
    },
    "llama-3.1-8b-instruct": {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
    },
}  # fmt: skip


@dataclass
class Case:
    model: str
    batch: int
    input: int
    mode: str  # graphs | eager
    step_ms: float | None = None
    tok_s: float | None = None
    roofline_ms: float | None = None
    fraction: float | None = None
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="deepseek-v2-lite, llama-3.1-8b-instruct, ...")
    p.add_argument("--folder", type=Path, help="an existing random checkpoint (default: generate one, then delete it)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()), help="where a generated one goes")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--inputs", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per case (after 2 untimed)")
    p.add_argument("--tiny", action="store_true", help="test-size shapes on CPU (checks the script itself)")
    p.add_argument("--peak-tbs", type=float, help="HBM peak in TB/s (default: from the GPU's name)")
    p.add_argument("--out", type=Path, help="folder for e2e_<model>.md / .json")
    return p.parse_args(argv)


def build_runner(folder: Path, args: argparse.Namespace, work: Path):
    """This process as the one rank of a tp1/dcp1 plan of `folder` (graphs captured on CUDA), and its resolved plan."""
    device = "cpu" if args.tiny else "cuda"
    plan = {
        "name": f"e2e-{args.model}",
        "model": {"path": str(folder), "dtype": "float32" if args.tiny else "bfloat16",
                  "max_model_len": max(*args.inputs, GREEDY_LEN) + args.steps + 64, "enforce_eager": False},
        "cache": {"block_size": BLOCK_SIZE, "memory": "256MiB" if args.tiny else 0.85},
        "attention": {"backend": "cpu" if args.tiny else "triton"},
        "scheduler": {"max_num_seqs": max(args.batches)},
        "launch": {"device": device},
    }  # fmt: skip
    path = work / "e2e-plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    resolved = resolve_plan(path)
    return start_rank(resolved)[2], resolved


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_steps(runner, batch: int, context: int, steps: int, first_block: int = 0) -> float:
    """Mean seconds of one decode step of `batch` sequences with `context` cached tokens each (2 untimed first)."""
    per_seq = -(-(context + steps + 3) // BLOCK_SIZE)
    tables = [list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq)) for i in range(batch)]
    tokens = [7] * batch
    start = 0.0
    for s in range(steps + 2):
        if s == 2:
            synchronize(runner.device)
            start = time.perf_counter()
        step = ScheduledStep([ScheduledChunk(i, [tokens[i]], context + s, tables[i], True) for i in range(batch)])
        tokens = runner.execute(step).logits.argmax(-1).tolist()
    synchronize(runner.device)
    return (time.perf_counter() - start) / steps


def greedy_tokens(runner, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy continuation of `prompts` through the runner: one prefill step, then `new` - 1 decode steps."""
    per_seq = -(-(max(map(len, prompts)) + new + 1) // BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    prefill = ScheduledStep([ScheduledChunk(i, p, 0, tables[i], True) for i, p in enumerate(prompts)])
    out = [[t] for t in runner.execute(prefill).logits.argmax(-1).tolist()]
    for s in range(new - 1):
        chunks = [
            ScheduledChunk(i, [o[-1]], len(p) + s, tables[i], True)
            for i, (p, o) in enumerate(zip(prompts, out, strict=True))
        ]
        for o, t in zip(out, runner.execute(ScheduledStep(chunks)).logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return out


def step_bytes(runner, kv_bytes_per_token: int, top_k: int, batch: int, context: int) -> int:
    """HBM bytes a decode step must read: weights (routed experts: those `batch` tokens can reach) + cached KV."""
    weights = 0
    for name, p in runner.model.named_parameters():
        size = p.numel() * p.element_size()
        if "embed_tokens" in name and not runner.model.tied:
            continue
        if name.endswith((".experts.w13", ".experts.w2")):
            size = size * (1 - (1 - top_k / p.shape[0]) ** batch)
        weights += size
    return int(weights + batch * context * kv_bytes_per_token)


def moe_microbench(runner, top_k: int, device: torch.device) -> list[dict]:
    """Fused experts vs the per-expert loop on the first MoE layer's weights, at 1, 8 and 64 tokens."""
    from engine.layers.fused_moe import fused_experts
    from engine.layers.moe import Experts, experts_loop

    layer = next((m for m in runner.model.modules() if isinstance(m, Experts)), None)
    if layer is None:
        return []
    rows = []
    hidden, experts = layer.w13.shape[2], layer.w13.shape[0]
    gen = torch.Generator(device=device).manual_seed(0)
    for tokens in (1, 8, 64):
        x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=layer.w13.dtype)
        scores = torch.randn(tokens, experts, generator=gen, device=device).softmax(-1)
        weights, ids = scores.topk(top_k, dim=-1)
        timing = {}
        for name, fn in (("fused", fused_experts), ("loop", experts_loop)):
            if name == "fused" and device.type != "cuda":
                continue  # the interpreter's time says nothing
            for _ in range(3):
                fn(x, layer.w13, layer.w2, weights, ids)
            synchronize(device)
            start = time.perf_counter()
            for _ in range(10):
                fn(x, layer.w13, layer.w2, weights, ids)
            synchronize(device)
            timing[name] = (time.perf_counter() - start) / 10 * 1e3
        rows.append({"tokens": tokens, **{f"{k}_ms": v for k, v in timing.items()}})
    return rows


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --tiny for the CPU smoke run")
    work = Path(tempfile.mkdtemp(prefix="e2e-", dir=args.work))
    report: dict = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    report["torch"], report["triton"] = torch.__version__, __import__("triton").__version__
    folder = args.folder
    try:
        if folder is None:
            start = time.perf_counter()
            folder = make_random_checkpoint(
                args.model,
                work / args.model,
                overrides=TINY[args.model] if args.tiny else None,
                dtype="float32" if args.tiny else "bfloat16",
                device=device.type,
            )
            report["generate_s"] = round(time.perf_counter() - start, 1)
        start = time.perf_counter()
        runner, resolved = build_runner(folder, args, work)
        top_k = _top_k(folder)
        report["load_and_capture_s"] = round(time.perf_counter() - start, 1)
        report["weight_gib"] = round(runner.weight_bytes / 2**30, 2)
        report["kv_cache_gib"] = round(runner.kv_cache_bytes / 2**30, 2)
        report["graph_sizes"] = runner.graphs.sizes if runner.graphs else []
        report["graph_capture_s"] = round(runner.graphs.capture_seconds, 1) if runner.graphs else None
        kv_token = resolved.model.kv_bytes_per_token(1, runner.kv_cache.element_size())
        blocks = runner.cache_layout.num_blocks
        peak = peak_tbs(device.type, args.peak_tbs)
        report["peak_tbs"] = peak

        prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(n)] for i, n in enumerate(GREEDY_PROMPTS)]
        modes = {"graphs": runner.graphs, "eager": None} if runner.graphs else {"eager": None}
        tokens = {}
        for mode, graphs in modes.items():
            runner.graphs = graphs
            tokens[mode] = greedy_tokens(runner, prompts, GREEDY_NEW)
        report["greedy_graphs_equal_eager"] = tokens.get("graphs", tokens["eager"]) == tokens["eager"]

        cases = []
        for context in args.inputs:
            for batch in args.batches:
                need = batch * -(-(context + args.steps + 3) // BLOCK_SIZE)
                for mode, graphs in modes.items():
                    case = Case(args.model, batch, context, mode)
                    cases.append(case)
                    if need > blocks:
                        case.note = f"KV does not fit: {need} blocks of {blocks}"
                        continue
                    runner.graphs = graphs
                    seconds = decode_steps(runner, batch, context, args.steps)
                    case.step_ms, case.tok_s = seconds * 1e3, batch / seconds
                    if peak:
                        case.roofline_ms = step_bytes(runner, kv_token, top_k, batch, context) / (peak * 1e12) * 1e3
                        case.fraction = case.roofline_ms / case.step_ms
        runner.graphs = modes.get("graphs")
        report["cases"] = [asdict(c) for c in cases]
        report["moe"] = moe_microbench(runner, top_k, device)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return report


def _top_k(folder: Path) -> int:
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("num_experts_per_tok") or 1)


def markdown(report: dict) -> str:
    lines = [
        f"### {report['model']} on {report['device']} (torch {report['torch']}, triton {report['triton']})",
        "",
        f"weights {report['weight_gib']} GiB, KV cache {report['kv_cache_gib']} GiB, generate "
        f"{report.get('generate_s', '-')} s, load + capture {report['load_and_capture_s']} s, graphs "
        f"{report['graph_sizes'] or 'none'}; greedy tokens graphs on == off: {report['greedy_graphs_equal_eager']}",
        "",
        "| batch | input | mode | step ms | tok/s | roofline ms | of roofline | graphs / eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    eager = {(c["batch"], c["input"]): c for c in report["cases"] if c["mode"] == "eager"}
    for c in report["cases"]:
        if c["step_ms"] is None:
            lines.append(f"| {c['batch']} | {c['input']} | {c['mode']} | {c['note']} | | | | |")
            continue
        e = eager[(c["batch"], c["input"])]
        speedup = f"{e['step_ms'] / c['step_ms']:.2f}x" if c["mode"] == "graphs" else ""
        roof = f"{c['roofline_ms']:.2f}" if c["roofline_ms"] else "-"
        frac = f"{c['fraction']:.0%}" if c["fraction"] else "-"
        lines.append(f"| {c['batch']} | {c['input']} | {c['mode']} | {c['step_ms']:.2f} | {c['tok_s']:.0f} | "
                     f"{roof} | {frac} | {speedup} |")  # fmt: skip
    if report["moe"]:
        lines += ["", "| MoE tokens | fused ms | per-expert loop ms |", "|---|---|---|"]
        for r in report["moe"]:
            lines.append(f"| {r['tokens']} | {r.get('fused_ms', float('nan')):.3f} | {r['loop_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"e2e_{args.model}.md").write_text(text)
        (args.out / f"e2e_{args.model}.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["greedy_graphs_equal_eager"] else 1


if __name__ == "__main__":
    sys.exit(main())
