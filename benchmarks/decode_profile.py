"""Where a decode step goes, on every rank: the same decode-only steps of each rank of a plan, broken down by timers.

    python benchmarks/decode_profile.py PLAN [KEY=VALUE ...] [--batch 8] [--prompt-len 512] [--warmup 8]
        [--steps 16] [--prefault] [--output DIR]

A plan of several ranks is started with torchrun (this script again, one process per rank, one thread each as
`dcpctl run` starts them); a one-rank plan runs in this process. Each rank times the decode-only steps before the
window (timers off), then, for `--steps` more, the wall time of every linear layer's matmul (by layer name), the KV
write, the local paged attention, the DCP combine, RMSNorm, rotary and each collective by the layer that calls it
(its wait for the peer included), and writes them to DIR/rank{r}.json; the launching process prints one table per
rank. (torch.profiler crashed these processes with torch 2.13 on CPU, so the timers are the engine's own calls,
wrapped in place.) `--prefault` touches every page of the KV cache first, as a server's cache is once each block has
been written: otherwise the KV write of a fresh process also pays the first-touch page faults of the cache's pages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# what is timed: (module, attribute, label); a class attribute is a method, timed on every instance
TIMED = (
    ("engine.kernels.cpu_gemm", "PackableLinear.project", "matmul"),  # label completed by the layer's name
    ("engine.attention.cpu_backend", "CpuBackend.write_cache", "attention: KV write"),
    # Llama-family layers: rotary and the KV write in one call (without the kernels its time also counts in the
    # "KV write" and "rotary" rows, which it calls)
    ("engine.attention.cpu_backend", "CpuBackend.rotate_and_write", "attention: rotary + KV write"),
    ("engine.attention.cpu_backend", "CpuBackend.paged", "attention: local paged decode"),
    ("engine.attention.dcp_combine", "combine", "DCP combine (whole)"),
    ("engine.layers.norm", "RMSNorm.forward", "RMSNorm"),
    ("engine.layers.rotary", "RotaryEmbedding.apply", "rotary"),
    # the layers' call sites of the collectives
    ("engine.layers.linear", "all_reduce", "collective: all_reduce, row-parallel linears (o_proj, down_proj)"),
    ("engine.layers.embedding", "all_reduce", "collective: all_reduce, embedding"),
    ("engine.layers.embedding", "gather_to_first", "collective: gather, LM head logits"),
    ("engine.attention.dcp_combine", "all_gather_rows", "collective: all_gather, combine LSEs"),
    ("engine.attention.dcp_combine", "reduce_scatter_rows", "collective: reduce_scatter, combine"),
    ("engine.attention.dcp_combine", "all_to_all_rows", "collective: all_to_all, combine"),
)
COMBINE_COLLECTIVES = ("combine LSEs", "reduce_scatter, combine", "all_to_all, combine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE plan overrides")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before the broken-down ones (timed whole)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps broken down by the timers")
    parser.add_argument("--prefault", action="store_true", help="touch every KV cache page before the run")
    parser.add_argument("--output", type=Path, default=Path("runs/decode_profile"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ:
        profile_rank(args)
        return
    from engine.plan.checks import resolve_plan

    world = resolve_plan(args.plan, args.overrides).world_size or 1
    for old in args.output.glob("rank*.json"):
        old.unlink()
    if world == 1:
        profile_rank(args)
    else:
        from engine.runtime.launcher import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), LOGLEVEL="ERROR")
        subprocess.run(cmd, env=env, check=True)
    for rank in range(world):
        print_rank(json.loads((args.output / f"rank{rank}.json").read_text()))


def profile_rank(args: argparse.Namespace) -> None:
    """Run the workload (rank 0 drives, the others follow) with this rank's decode steps timed, then broken down."""
    import importlib

    import torch

    from engine.attention import kv_cache
    from engine.core.sequence import SamplingParams
    from engine.runtime.model_runner import ModelRunner

    rank = int(os.environ.get("RANK", "0"))
    parts: dict[str, list[float]] = {}  # label -> [seconds, calls] within the broken-down steps
    state = {"decode_steps": 0, "timed": [], "broken_down": [], "on": False}
    for module_name, attribute, label in TIMED:
        owner = importlib.import_module(module_name)
        *classes, name = attribute.split(".")
        for cls in classes:
            owner = getattr(owner, cls)
        setattr(owner, name, _timed(getattr(owner, name), label, parts, state))

    build = ModelRunner.__init__

    def init(self, *a, **k):
        build(self, *a, **k)
        for name, module in self.model.named_modules():
            module.profile_name = name.rsplit(".", 1)[-1]  # qkv_proj, o_proj, gate_up_proj, down_proj, lm_head

    ModelRunner.__init__ = init
    allocate = ModelRunner.allocate_cache

    def allocate_faulted(self, layout):
        allocate(self, layout)
        kv_cache.fault_in(self.kv_cache)

    if args.prefault:
        ModelRunner.allocate_cache = allocate_faulted
    execute = ModelRunner.execute
    end = args.warmup + args.steps

    def timed_execute(self, step):
        if not step.chunks or step.num_prefills or len(step.chunks) != args.batch:
            return execute(self, step)
        n = state["decode_steps"]
        state["decode_steps"] += 1
        state["on"] = args.warmup <= n < end
        start = time.perf_counter()
        out = execute(self, step)
        elapsed = time.perf_counter() - start
        state["on"] = False
        if 2 <= n < args.warmup:
            state["timed"].append(elapsed)
        elif args.warmup <= n < end:
            state["broken_down"].append(elapsed)
            if n == end - 1:
                _write(args.output / f"rank{rank}.json", rank, self, state, parts, args)
        return out

    ModelRunner.execute = timed_execute
    from engine.llm import LLM

    llm = LLM(args.plan, args.overrides)  # the other ranks follow rank 0 inside this call and exit when it closes
    try:
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.runner.vocab_size
        prompts = [torch.randint(100, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
        llm.generate(
            prompts, SamplingParams(max_tokens=end + 16, temperature=0, ignore_eos=True)
        )  # past chunked prefill
    finally:
        llm.close()


def _timed(fn, label: str, parts: dict, state: dict):
    """fn, adding its wall time and calls to parts[label] while state["on"] (a matmul: per layer name)."""
    clock = time.perf_counter

    def call(*a, **k):
        if not state["on"]:
            return fn(*a, **k)
        start = clock()
        out = fn(*a, **k)
        key = f"{label}: {getattr(a[0], 'profile_name', '?')}" if label == "matmul" else label
        entry = parts.setdefault(key, [0.0, 0])
        entry[0] += clock() - start
        entry[1] += 1
        return out

    return call


def _write(path: Path, rank: int, runner, state: dict, parts: dict, args: argparse.Namespace) -> None:
    steps = len(state["broken_down"])
    record = {
        "rank": rank,
        "plan": args.plan,
        "overrides": args.overrides,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "steps": steps,
        "step_ms_untimed": 1e3 * sum(state["timed"]) / max(1, len(state["timed"])),
        "step_ms": 1e3 * sum(state["broken_down"]) / steps,
        "weight_mib": runner.weight_bytes / 2**20,
        "parts": {k: {"ms": 1e3 * v[0] / steps, "calls": v[1] // steps} for k, v in parts.items()},
    }
    path.write_text(json.dumps(record, indent=1))


def print_rank(record: dict) -> None:
    """One rank's decode step in ms: each timed part, the combine's own math, and what the parts leave over."""
    parts = record["parts"]
    combine = parts.pop("DCP combine (whole)", None)
    rows = sorted(parts.items(), key=lambda kv: kv[0])
    if combine is not None:
        inside = sum(v["ms"] for k, v in parts.items() if k.endswith(COMBINE_COLLECTIVES))
        rows.append(("DCP combine: merge math (without its collectives)", {"ms": combine["ms"] - inside, "calls": 0}))
    covered = sum(v["ms"] for _, v in rows)
    print(
        f"\nrank {record['rank']}: {record['plan']} {' '.join(record['overrides'])}  batch {record['batch']}, "
        f"prompt {record['prompt_len']}, {record['steps']} decode steps, weights {record['weight_mib']:.1f} MiB"
    )
    print("| part | ms per step | calls per step |\n|---|---:|---:|")
    print(f"| step (untimed) | {record['step_ms_untimed']:.2f} | |")
    print(f"| step (timed) | {record['step_ms']:.2f} | |")
    for name, value in rows:
        print(f"| {name} | {value['ms']:.2f} | {value['calls'] or ''} |")
    print(
        f"| the rest (embedding lookup, residual views, metadata, sampling prep, Python) | "
        f"{record['step_ms'] - covered:.2f} | |"
    )


if __name__ == "__main__":
    main()
