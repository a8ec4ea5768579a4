"""Seconds from starting a plan's server (as `dcpctl eval`/`bench` do) to the first 200 from GET /health, per plan.

Each plan is started and stopped `--repeats` times in turn (round-robin, so machine noise spreads
over all plans); prints a markdown table of the best and median time.

    python benchmarks/time_to_healthy.py plans/cpu/smollm2_tp1_dcp1.yaml plans/cpu/smollm2_tp1_dcp2_i16.yaml
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from evals.launch import PlanServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[Path, list[float]] = {plan: [] for plan in args.plans}
    for _ in range(args.repeats):
        for plan in args.plans:
            with PlanServer(plan) as server:
                times[plan].append(server.time_to_healthy_s)
    print("| plan | best (s) | median (s) | runs |")
    print("|---|---|---|---|")
    for plan, values in times.items():
        print(f"| {plan.stem} | {min(values):.2f} | {statistics.median(values):.2f} | {len(values)} |")


if __name__ == "__main__":
    main()
