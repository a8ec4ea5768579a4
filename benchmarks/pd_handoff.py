"""The P/D hand-off's cost per interleave, measured side by side: SmolLM2-135M, prefill tp1/dcp1 -> decode tp1/dcp2
at interleave 1, 16 and 64 (block 64), prompts of 512 and 2048 tokens.

The three deployments (plans/cpu/smollm2_pd_dcp2_i{1,16,64}.yaml) run at once and are cycled request by request
(interleaved rounds, one request in flight), so machine noise falls on all of them alike. Every pull also times one
raw NIXL READ of the same bytes as a single region, in the same processes (`disagg.measure_raw`): the ratio of the
hand-off's READ to that raw READ is the number to judge. Prompts are fresh random token ids each time (no prefix
cache hit on either side). Prints a markdown table (best-of-N and median) and writes every measurement as JSON.

    python benchmarks/pd_handoff.py [--rounds 7] [--lengths 512 2048] [--json runs/pd_handoff.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from engine.kernels import cpu_isa
from evals.launch import PlanServer, sigterm_interrupts

PLANS = {i: Path(f"plans/cpu/smollm2_pd_dcp2_i{i}.yaml") for i in (1, 16, 64)}
OVERRIDES = [  # a 2048-token prompt plus its output needs a context above the plans' 2048
    "disagg.measure_raw=true",
    "cache.memory=256MiB",
    "prefill.cache.memory=256MiB",
    "model.max_model_len=4096",
    "prefill.model.max_model_len=4096",
]


def one_request(client: httpx.Client, url: str, prompt: list[int], output_len: int) -> dict:
    """One streamed greedy request; the client's TTFT and the decode side's hand-off record."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    ttft, kv = None, None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - start
            if chunk.get("kv_transfer"):
                kv = chunk["kv_transfer"][0]
    if kv is None or "error" in kv:
        raise RuntimeError(f"no hand-off record: {kv}")
    return {"client_ttft_s": ttft, **kv}


def summarize(samples: list[dict]) -> dict:
    ranks = [r for s in samples for r in s["per_rank"]]
    transfer = [s["transfer_s"] for s in samples]  # the slowest rank of each pull
    raw = [max(r["raw_transfer_s"] for r in s["per_rank"]) for s in samples]
    ratios = [t / r for t, r in zip(transfer, raw, strict=True)]
    med = statistics.median
    return {
        "n": len(samples),
        "descriptors_per_rank": sorted({r["descriptors"] for r in ranks}),
        "mib_per_rank": max(r["bytes"] for r in ranks) / 2**20,
        "transfer_ms": (min(transfer) * 1e3, med(transfer) * 1e3),
        "raw_ms": (min(raw) * 1e3, med(raw) * 1e3),
        "ratio_of_mins": min(transfer) / min(raw),
        "ratio_median": med(ratios),
        "prefill_ms": med(s["prefill_s"] for s in samples) * 1e3,
        "claim_queue_ms": med(s["claim_s"] + s["queue_s"] for s in samples) * 1e3,
        "first_decode_ms": med(s["first_decode_s"] for s in samples) * 1e3,
        "client_ttft_ms": med(s["client_ttft_s"] for s in samples) * 1e3,
    }


def table(results: dict) -> str:
    lines = [
        "| input | interleave | descriptors per decode rank | MiB per rank | READ ms (min / median) | raw READ ms "
        "(min / median) | READ / raw (min / median) | TTFT split ms (prefill / claim+queue / transfer / first "
        "decode, medians) | client TTFT ms (median) |",
        "|---:|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for length, per_i in results.items():
        for interleave, s in per_i.items():
            lines.append(
                f"| {length} | {interleave} | {' / '.join(f'{d:,}' for d in s['descriptors_per_rank'])} | "
                f"{s['mib_per_rank']:.2f} | {s['transfer_ms'][0]:.2f} / {s['transfer_ms'][1]:.2f} | "
                f"{s['raw_ms'][0]:.2f} / {s['raw_ms'][1]:.2f} | {s['ratio_of_mins']:.2f} / {s['ratio_median']:.2f} | "
                f"{s['prefill_ms']:.0f} / {s['claim_queue_ms']:.1f} / {s['transfer_ms'][1]:.1f} / "
                f"{s['first_decode_ms']:.0f} | {s['client_ttft_ms']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--json", type=Path, default=Path("runs/pd_handoff.json"))
    args = parser.parse_args()
    from engine.checkpoints.pull import pull_model

    pull_model("smollm2-135m-instruct")
    rng = random.Random(18)
    load_before = os.getloadavg()
    servers = {i: PlanServer(plan, OVERRIDES, health_timeout_s=900) for i, plan in PLANS.items()}
    raw: dict[int, dict[int, list[dict]]] = {n: {i: [] for i in PLANS} for n in args.lengths}
    with sigterm_interrupts(), contextlib.ExitStack() as stop:  # SIGTERM stops the servers too
        for server in servers.values():
            stop.callback(server.stop)
            server.start()
        for server in servers.values():
            server.wait_healthy()
        with httpx.Client(timeout=600, trust_env=False) as client:
            for round_ in range(args.rounds + 1):  # round 0 warms up (first connections, first page faults)
                order = list(PLANS)[round_ % 3 :] + list(PLANS)[: round_ % 3]
                for n in args.lengths:
                    for i in order:
                        prompt = [rng.randrange(100, 40000) for _ in range(n)]
                        sample = one_request(client, servers[i].base_url, prompt, args.output_len)
                        if round_:
                            raw[n][i].append(sample)
                print(f"round {round_} done", flush=True)
    results = {n: {i: summarize(samples) for i, samples in per_i.items()} for n, per_i in raw.items()}
    load_after = os.getloadavg()
    header = (
        f"CPU {cpu_isa.detect().describe()}, {os.cpu_count()} cores; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after; {args.rounds} interleaved rounds, output {args.output_len} tokens"
    )
    print(header)
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"header": header, "results": results, "samples": raw}, indent=1))


if __name__ == "__main__":
    main()
