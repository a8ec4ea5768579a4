#!/usr/bin/env bash
# Shared memory vs gloo for the CPU collectives, end to end in `dcpctl bench`, on two plans of two ranks:
#   smollm2_tp1_dcp2_i16  SmolLM2-135M-Instruct, replica layout (plans/cpu/smollm2_tp1_dcp2_i16.yaml): per layer the
#                         DCP combine's LSE all-gather and reduce-scatter, per step the logits gather
#   llama_tp2_dcp2_i16    a random Llama of SmolLM2's size with 8 heads / 1 KV head (`dcpctl model tiny`, with
#                         SmolLM2's tokenizer so that its output decodes to text), tp2 with DCP inside the TP group:
#                         per layer two TP all-reduces, the query all-gather and the combine
# each with launch.cpu_comm=gloo and =shm, random prompts of INPUT_LEN (512) tokens, 128 output tokens, NUM_PROMPTS
# (16) requests at concurrency 8. ROUNDS (2) rounds, the two variants launched in turn, their order swapped every
# round (FIRST_ROUND, default 1, continues a run; PLANS limits the plans); the summary takes each variant's best
# round and gives shm's figures over gloo's.
#
#   bash benchmarks/bench_cpu_comm.sh [OUTPUT_DIR]          # default runs/bench_cpu_comm
#
# The variants are plans derived (`base:`) from plans/cpu/ in OUTPUT_DIR/plans.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/bench_cpu_comm}"
dcpctl="${DCPCTL:-.venv/bin/dcpctl}"
python="${PYTHON:-.venv/bin/python}"
mkdir -p "$out/plans"

"$dcpctl" model pull smollm2-135m-instruct >/dev/null
smollm2="$("$python" -c 'from engine.checkpoints.aliases import resolve_model_path as r; print(r("smollm2-135m-instruct"))')"
model="$out/llama_smollm2_size"
[ -f "$model/config.json" ] || "$dcpctl" model tiny "$model" --arch llama --force --hidden-size 576 \
    --num-layers 30 --num-heads 8 --num-kv-heads 1 --head-dim 64 --intermediate-size 1536 --vocab-size 49152 \
    --max-position-embeddings 2048 >/dev/null
cp "$smollm2"/tokenizer.json "$smollm2"/tokenizer_config.json "$smollm2"/chat_template.jinja "$model"/

for comm in gloo shm; do
    cat >"$out/plans/smollm2_tp1_dcp2_i16_$comm.yaml" <<PLAN
base: $(pwd)/plans/cpu/smollm2_tp1_dcp2_i16.yaml
name: smollm2_tp1_dcp2_i16_$comm
launch:
  cpu_comm: $comm
PLAN
    cat >"$out/plans/llama_tp2_dcp2_i16_$comm.yaml" <<PLAN
base: $(pwd)/plans/cpu/base.yaml
name: llama_tp2_dcp2_i16_$comm
description: "random SmolLM2-sized Llama, 1 KV head: tp2 with DCP inside the TP group"
model:
  path: $(cd "$model" && pwd)
parallel:
  tp: 2
  dcp: 2
  interleave: 16
launch:
  cpu_comm: $comm
PLAN
done

rounds="${ROUNDS:-2}"
for round in $(seq "${FIRST_ROUND:-1}" "$rounds"); do
    order=(gloo shm)
    [ $((round % 2)) -eq 0 ] && order=(shm gloo)
    mkdir -p "$out/round$round"
    for plan in ${PLANS:-smollm2_tp1_dcp2_i16 llama_tp2_dcp2_i16}; do
        echo "round $round: $plan (${order[*]}), load average $(cut -d' ' -f1 /proc/loadavg)" >&2
        "$dcpctl" bench "$out/plans/${plan}_${order[0]}.yaml" "$out/plans/${plan}_${order[1]}.yaml" \
            --input-len "${INPUT_LEN:-512}" --output-len 128 --num-prompts "${NUM_PROMPTS:-16}" --concurrency 8 \
            --seed 0 --warmup 2 --output "$out/round$round/$plan" >"$out/round$round/$plan.log" 2>&1 ||
            { tail -20 "$out/round$round/$plan.log" >&2; exit 1; }
    done
done

"$python" - "$out" <<'SUMMARY'
import json, sys
from pathlib import Path

best: dict[str, dict[str, float]] = {}
for path in sorted(Path(sys.argv[1]).glob("round*/*/bench.json")):
    for target in json.loads(path.read_text())["targets"]:
        m = target["metrics"]
        if target["error"] or m is None or m["failed"]:
            sys.exit(f"{path}: {target['label']} failed: {target['error']}")
        figures = {"tok/s": m["output_throughput"], "TPOT p50": m["tpot"]["p50"] * 1e3, "ITL p50": m["itl"]["p50"] * 1e3}
        old = best.setdefault(target["label"], figures)
        best[target["label"]] = {k: (max if k == "tok/s" else min)(old[k], v) for k, v in figures.items()}
print("| plan | gloo tok/s | shm tok/s | shm/gloo | gloo TPOT p50 ms | shm TPOT p50 ms | shm/gloo | gloo ITL p50 ms | shm ITL p50 ms |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for plan in sorted({label.rsplit("_", 1)[0] for label in best}):
    g, s = best[f"{plan}_gloo"], best[f"{plan}_shm"]
    print(
        f"| {plan} | {g['tok/s']:.1f} | {s['tok/s']:.1f} | {s['tok/s'] / g['tok/s']:.2f}x | {g['TPOT p50']:.1f} | "
        f"{s['TPOT p50']:.1f} | {s['TPOT p50'] / g['TPOT p50']:.2f}x | {g['ITL p50']:.1f} | {s['ITL p50']:.1f} |"
    )
SUMMARY
