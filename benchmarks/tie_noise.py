"""How far log-probabilities move between plans (and between two runs of the same plan) where they generate on the
same prefix: the numerical noise the tie margins of `evals.divergence.TIE_MARGINS` are chosen from.

Runs `dcpctl eval gsm8k --compare` on a slice of the GSM8K test questions (not the first ones, so that the
questions a margin is checked on are not those it was chosen on) with the baseline plan twice and the DCP plans,
all in one dtype, then prints per plan what `comparison.json` measured: over every position where the plan and
the baseline generated on the same prefix, the largest change of the gap between the chosen token and each rival
listed in both runs (a tie flips only if that gap can change sign), its 99th percentile, and the tie flips and
unexplained divergences under the current margin.

    python benchmarks/tie_noise.py --dtype bfloat16 --data-dir ../shared/data/gsm8k --start 500 --count 40 \\
        --output runs/tie_noise_bf16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.io_utils import atomic_write_text
from evals.divergence import TIE_MARGINS

PLANS = [
    "plans/cpu/smollm2_tp1_dcp1.yaml",
    "plans/cpu/smollm2_tp1_dcp1.yaml",  # the baseline again: run-to-run noise (other batch shapes)
    "plans/cpu/smollm2_tp1_dcp2_i1.yaml",
    "plans/cpu/smollm2_tp1_dcp2_i16.yaml",
    "plans/cpu/smollm2_tp1_dcp2_i64.yaml",
]


def write_slice(data_dir: Path, start: int, count: int, out: Path) -> Path:
    """A GSM8K data folder holding test questions [start, start + count) and the whole train split."""
    test = (data_dir / "test.jsonl").read_text().splitlines()[start : start + count]
    if len(test) < count:
        raise SystemExit(f"{data_dir}/test.jsonl has fewer than {start + count} questions")
    atomic_write_text(out / "test.jsonl", "".join(line + "\n" for line in test))
    atomic_write_text(out / "train.jsonl", (data_dir / "train.jsonl").read_text())
    return out


def summary(cmp: dict, dtype: str) -> Table:
    table = Table(title=f"logprob noise against {cmp['columns'][0]['label']} ({dtype}, {cmp['n_common']} questions)")
    for name in ("plan", "positions", "token pairs", "max gap change", "p99 gap change", "max logprob change"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    for name in ("tie flips", "unexplained"):
        table.add_column(name, justify="right")
    for col in cmp["columns"][1:]:
        n = col["noise"] or {}

        def num(key: str, n: dict = n) -> str:
            return "—" if n.get(key) is None else f"{n[key]:.4g}"

        table.add_row(
            col["label"],
            str(n.get("positions", "—")),
            str(n.get("pairs", "—")),
            num("max_gap_change"),
            num("p99_gap_change"),
            num("max_logprob_change"),
            str(col["tie_flips"]),
            str(col["unexplained_divergences"]),
        )
    table.caption = f"current tie margin for {dtype}: {TIE_MARGINS[dtype]} nats"
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TIE_MARGINS))
    parser.add_argument("--data-dir", type=Path, required=True, help="GSM8K folder (test.jsonl, train.jsonl)")
    parser.add_argument("--start", type=int, default=500, help="first test question of the slice")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--num-fewshot", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("runs/tie_noise"))
    args, extra = parser.parse_known_args()  # anything else goes to dcpctl eval (e.g. --fixed-fewshot)

    data = write_slice(args.data_dir, args.start, args.count, args.output / "data")
    cmd = [str(Path(sys.executable).parent / "dcpctl"), "eval", "gsm8k", "--compare", *PLANS]
    cmd += [f"model.dtype={args.dtype}", "--data-dir", str(data), "--num-fewshot", str(args.num_fewshot)]
    cmd += ["--output", str(args.output), *extra]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    cmp = json.loads((args.output / "comparison.json").read_text())
    Console(width=160).print(summary(cmp, args.dtype))


if __name__ == "__main__":
    main()
