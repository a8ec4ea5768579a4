"""How the OpenMP wait policy changes a batched decode step, on idle cores and on cores other processes also want.

    python benchmarks/wait_policy.py [--dtype float32] [--batch 16] [--steps 64] [--hogs 0 2]

For each policy (the engine's PASSIVE, libgomp's spin-then-sleep with a few GOMP_SPINCOUNT values, ACTIVE) and each
`--hogs` count (that many busy-looping processes of this script's own, started before and ended after the policy's
run, as a shared machine's other work): one process loads SmolLM2-135M-Instruct like vs_vllm's dcpctl worker (threads
bound to this process's cores), prefills `--batch` seeded random 128-token prompts, and times the decode steps:
(best of 2 generates of 1 + `--steps` tokens minus best of 3 of 1 token) / `--steps`. Prints ms per decode step.
libgomp reads these variables once, when torch loads, so every policy gets its own process. GOMP_SPINCOUNT, where
set, replaces the spin count OMP_WAIT_POLICY implies (0 for PASSIVE; libgomp reckons ~100,000 spins per ms).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICIES = {
    "PASSIVE (engine default)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 1k (~10 µs), then sleep": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
    "spin 10k (~100 µs), then sleep": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
}
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def measure(dtype: str, batch: int, steps: int) -> dict[str, float]:
    """ms per decode step of `batch` sequences in this process, and the engine's torch thread count."""
    import random

    import yaml

    from engine import LLM, SamplingParams  # before torch loads: its wait-policy and core-count set-up

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(batch)]
    plan = Path(tempfile.mkdtemp()) / "plan.yaml"
    settings = {
        "model": {"path": "smollm2-135m-instruct", "dtype": dtype, "max_model_len": 1024},
        "cache": {"block_size": 16, "memory": "512MiB", "prefix_caching": False},
        "launch": {"device": "cpu"},
        "scheduler": {"max_num_seqs": batch, "max_num_batched_tokens": 4096},
    }
    plan.write_text(yaml.safe_dump(settings))

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    with LLM(plan) as llm:
        timed(2)  # warm-up
        prefill = min(timed(1) for _ in range(3))
        step_ms = (min(timed(1 + steps) for _ in range(2)) - prefill) / steps * 1e3
        import torch

        return {"step_ms": step_ms, "threads": torch.get_num_threads()}


def run_policy(policy: dict[str, str], hogs: int, args: argparse.Namespace) -> dict[str, float] | None:
    """`measure` in a fresh process with `policy`'s variables, `hogs` busy loops running meanwhile."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES} | policy
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env.setdefault("GOMP_CPU_AFFINITY", cores)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        cmd = [sys.executable, __file__, "--worker", "--dtype", args.dtype, "--batch", str(args.batch)]
        result = subprocess.run(
            [*cmd, "--steps", str(args.steps)], env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return None
    finally:
        for process in busy:
            process.kill()
            process.wait()
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--hogs", type=int, nargs="+", default=[0, 2], help="busy-looping processes during a run")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per policy run")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.dtype, args.batch, args.steps)))
        return
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"{args.dtype}, batch {args.batch}, ms per decode step (best of 2 x {args.steps} steps); load {load}")
    print("| policy | " + " | ".join(f"{h} busy loops" for h in args.hogs) + " |")
    print("|---|" + "---:|" * len(args.hogs))
    for name, policy in POLICIES.items():
        cells = []
        for hogs in args.hogs:
            run = run_policy(policy, hogs, args)
            cells.append("timed out" if run is None else f"{run['step_ms']:.1f} ({run['threads']} threads)")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
