"""Load test of `dcpctl run PLAN`: many concurrent streaming clients, some of which hang up mid-stream, for a
bounded time on loopback; then checks that nothing leaked.

Each of `--clients` clients loops until `--duration` is over: it streams a greedy /v1/completions request of a
random `--input-len`-token prompt for up to `--output-len` tokens (the bench client's request), and with
probability `--disconnect` closes the connection after a random number of chunks. Afterwards the server must be
healthy with no request in flight and no KV block used. One markdown row per plan and client count:

    python benchmarks/server_load.py plans/cpu/smollm2_tp1_dcp1.yaml plans/cpu/smollm2_tp1_dcp2_i16.yaml \
        --clients 64 256 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.plan.checks import resolve_plan
from evals.bench.client import RequestRecord, completion_body
from evals.bench.metrics import Stat
from evals.bench.workload import load_tokenizer, random_prompts, sampleable_ids
from evals.launch import PlanServer

IDLE_TIMEOUT_S = 60.0  # how long the server may take to settle after the clients stop


@dataclass
class LoadRun:
    """What one client count did against one server."""

    plan: str
    clients: int
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)
    disconnected: int = 0  # requests the client hung up on, on purpose
    after: dict = field(default_factory=dict)  # engine stats once idle
    health_after: int | None = None
    load_before: float = field(default_factory=lambda: os.getloadavg()[0])  # other work on the machine

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok and r.end_time is not None]

    @property
    def errors(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is not None]

    def row(self) -> dict:
        ttft = Stat.of([r.ttft for r in self.records if r.ttft is not None])
        tokens = sum(r.output_tokens for r in self.completed)
        return {
            "plan": self.plan,
            "clients": self.clients,
            "duration_s": round(self.duration_s, 1),
            "requests": len(self.records),
            "completed": len(self.completed),
            "disconnected": self.disconnected,
            "errors": len(self.errors),
            "error_examples": sorted({r.error for r in self.errors})[:3],
            "output_tok_s": round(tokens / self.duration_s, 1),
            "ttft_p50_s": ttft.p50,
            "ttft_p99_s": ttft.p99,
            "used_blocks_after": self.after.get("used_blocks"),
            "in_flight_after": self.after.get("requests_in_flight"),
            "running_after": self.after.get("running"),
            "health_after": self.health_after,
            "load_1m_before": round(self.load_before, 2),
        }


async def _client(
    http: httpx.AsyncClient, run: LoadRun, prompts: list[list[int]], args, rng: random.Random, stop_at: float, t0
) -> None:
    """One client: requests back to back until `stop_at`; some are cut off after a few chunks."""
    while time.perf_counter() < stop_at:
        rec = RequestRecord(index=len(run.records), prompt_len=args.input_len)
        run.records.append(rec)
        hang_up = rng.randrange(1, args.output_len) if rng.random() < args.disconnect else None
        chunks = 0
        rec.send_time = time.perf_counter() - t0
        try:
            body = completion_body(None, rng.choice(prompts), args.output_len)
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = f"stream error: {chunk['error']['message'][:200]}"
                        break
                    if any(c.get("text") for c in chunk.get("choices") or []):
                        chunks += 1
                        now = time.perf_counter() - t0
                        rec.token_times.append(now)
                        rec.first_token_time = rec.first_token_time or now
                    if chunk.get("usage"):
                        rec.output_tokens = chunk["usage"]["completion_tokens"]
                    if hang_up is not None and chunks >= hang_up:
                        break  # leaving the block closes the connection mid-stream
            if hang_up is not None and chunks >= hang_up:
                run.disconnected += 1
                continue
            rec.end_time = time.perf_counter() - t0
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def _load(base_url: str, run: LoadRun, prompts: list[list[int]], args) -> None:
    limits = httpx.Limits(max_connections=run.clients + 8, max_keepalive_connections=run.clients)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout, trust_env=False) as http:
        t0 = time.perf_counter()
        stop_at = t0 + args.duration
        rngs = [random.Random(args.seed * 100_003 + i) for i in range(run.clients)]
        await asyncio.gather(*(_client(http, run, prompts, args, rng, stop_at, t0) for rng in rngs))
        run.duration_s = time.perf_counter() - t0


def _settle(base_url: str, run: LoadRun) -> None:
    """Wait until the engine is idle, then record its stats and /health."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    with httpx.Client(base_url=base_url, timeout=10, trust_env=False) as http:
        while True:
            stats = http.get("/v1/engine/stats").json()
            idle = not (stats["running"] or stats["waiting"] or stats["requests_in_flight"])
            if (idle and stats["used_blocks"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        run.after = stats
        run.health_after = http.get("/health").status_code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+", type=Path)
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per client count")
    parser.add_argument("--disconnect", type=float, default=0.25, help="share of requests cut off mid-stream")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for plan in args.plans:
        vocab = sampleable_ids(load_tokenizer(resolve_plan(plan).model_path))
        prompts = random_prompts(vocab, 256, args.input_len, args.seed)
        with PlanServer(plan) as server:
            for clients in args.clients:
                run = LoadRun(plan.stem, clients, args.duration)
                asyncio.run(_load(server.base_url, run, prompts, args))
                _settle(server.base_url, run)
                rows.append(run.row())
                print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| plan | clients | s | requests | completed | disconnected | errors | output tok/s | TTFT p50 | TTFT p99 "
        "| used blocks after | in flight after | /health after | load (1 min) before |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p50 = f"{r['ttft_p50_s']:.2f} s" if r["ttft_p50_s"] is not None else "-"
        p99 = f"{r['ttft_p99_s']:.2f} s" if r["ttft_p99_s"] is not None else "-"
        print(
            f"| {r['plan']} | {r['clients']} | {r['duration_s']} | {r['requests']} | {r['completed']} | "
            f"{r['disconnected']} | {r['errors']} | {r['output_tok_s']} | {p50} | {p99} | {r['used_blocks_after']} | "
            f"{r['in_flight_after']} | {r['health_after']} | {r['load_1m_before']} |"
        )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
