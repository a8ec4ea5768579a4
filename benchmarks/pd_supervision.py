"""How fast `dcpctl run` brings a P/D deployment back: serve a P/D plan (default SmolLM2, prefill tp1/dcp1 -> decode
tp1/dcp2 interleave 16), SIGKILL its prefill instance, then its decode instance (each with all its processes), in
turn, and time from the kill: the report on the terminal, the new process healthy (the supervisor's own figure,
from detection), the router's /health 200 again, and the first greedy completion that succeeds (checked to be the
same tokens as before the kill). Prints a markdown table (median, min, max per instance) and writes every sample
as JSON.

    python benchmarks/pd_supervision.py [--plan plans/cpu/smollm2_pd_dcp2_i16.yaml] [--kills 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import time
from pathlib import Path

import httpx
import psutil

from engine.kernels import cpu_isa
from engine.serving.plan_server import PlanServer, sigterm_interrupts

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def wait(predicate, timeout_s: float = 600.0, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(poll_s)
    return value


def instance(run: PlanServer, role: str) -> psutil.Process:
    (proc,) = [p for p in run.processes() if "engine.serve_entry" in p.cmdline() and role in p.cmdline()]
    return proc


def completion(client: httpx.Client, url: str) -> list[str] | None:
    with contextlib.suppress(httpx.HTTPError):
        response = client.post(f"{url}/v1/completions", json=BODY)
        if response.status_code == 200:
            return [c["text"] for c in response.json()["choices"]]
    return None


def one_kill(run: PlanServer, client: httpx.Client, role: str, expected: list[str], number: int) -> dict:
    victim = instance(run, role)
    lines_before = run.log_path.read_text().count("\n")
    start = time.monotonic()
    for p in [victim, *victim.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            p.kill()

    def new_line(pattern: str):
        lines = run.log_path.read_text().splitlines()[lines_before:]
        return next((m for line in lines if (m := re.search(pattern, line))), None)

    wait(lambda: new_line(rf"the {role} instance .* was killed by SIGKILL"), 60, 0.01)
    reported = time.monotonic() - start
    wait(lambda: client.get(f"{run.base_url}/health").status_code == 503)  # the router has seen it (polls each 1 s)
    wait(lambda: client.get(f"{run.base_url}/health").status_code == 200)
    router_healthy = time.monotonic() - start
    got = wait(lambda: completion(client, run.base_url))
    first_ok = time.monotonic() - start
    if got != expected:
        raise RuntimeError(f"after restart {number} of the {role} instance: {got} != {expected}")
    healthy = new_line(rf"the {role} instance .* is healthy again: ([\d.]+) s after it was found dead, ([\d.]+) s")
    return {
        "role": role,
        "reported_s": reported,
        "detection_to_healthy_s": float(healthy.group(1)),
        "start_s": float(healthy.group(2)),
        "router_healthy_s": router_healthy,
        "first_completion_s": first_ok,
    }


def table(samples: list[dict]) -> str:
    keys = ("reported_s", "detection_to_healthy_s", "start_s", "router_healthy_s", "first_completion_s")
    lines = [
        "| instance | kills | kill -> reported | detection -> healthy (supervisor) | new process start "
        "| kill -> router /health 200 | kill -> first completion |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for role in ("prefill", "decode"):
        mine = [s for s in samples if s["role"] == role]
        cells = []
        for key in keys:
            values = [s[key] for s in mine]
            cells.append(f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {role} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=Path("plans/cpu/smollm2_pd_dcp2_i16.yaml"))
    parser.add_argument("--kills", type=int, default=3, help="kills of each instance")
    parser.add_argument("--json", type=Path, default=Path("runs/pd_supervision.json"))
    args = parser.parse_args()
    from engine.checkpoints.pull import pull_model

    pull_model("smollm2-135m-instruct")
    overrides = [f"disagg.max_restarts={args.kills}"]
    run = PlanServer(args.plan, overrides, health_timeout_s=900)
    samples = []
    with sigterm_interrupts(), run, httpx.Client(timeout=120, trust_env=False) as client:
        expected = wait(lambda: completion(client, run.base_url))
        for number in range(1, args.kills + 1):
            for role in ("prefill", "decode"):
                samples.append(one_kill(run, client, role, expected, number))
                print(json.dumps(samples[-1]), flush=True)
        restarts = client.get(f"{run.base_url}/v1/engine/stats").json()["router"]["restarts"]
    header = (
        f"{args.plan} on CPU {cpu_isa.detect().describe()}, {os.cpu_count()} cores; {args.kills} SIGKILLs of each "
        f"instance, in turn; restarts counted by the router: {restarts}"
    )
    print(header)
    print(table(samples))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"header": header, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
