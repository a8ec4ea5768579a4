#!/usr/bin/env bash
# Shared memory vs gloo for the CPU collectives, in `dcpctl bench`: SmolLM2-135M-Instruct tp1/dcp1 (one rank, the
# baseline) and tp1/dcp2 interleave 16 with launch.cpu_comm=gloo and =shm, input 512 / output 128 tokens, 32 prompts
# at concurrency 8, launched in turn in one run.
#
#   bash benchmarks/bench_cpu_comm.sh [OUTPUT_DIR]          # default runs/bench_cpu_comm
#
# The two dcp2 variants are plans derived (`base:`) from plans/cpu/smollm2_tp1_dcp2_i16.yaml in a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/bench_cpu_comm}"
dcpctl="${DCPCTL:-.venv/bin/dcpctl}"
plans="$(mktemp -d)"
trap 'rm -rf "$plans"' EXIT

for comm in gloo shm; do
    cat >"$plans/smollm2_tp1_dcp2_i16_$comm.yaml" <<PLAN
base: $(pwd)/plans/cpu/smollm2_tp1_dcp2_i16.yaml
name: smollm2_tp1_dcp2_i16_$comm
description: "two replica ranks, KV sharded in runs of 16 tokens, collectives through $comm"
launch:
  cpu_comm: $comm
PLAN
done

"$dcpctl" model pull smollm2-135m-instruct >/dev/null
"$dcpctl" bench plans/cpu/smollm2_tp1_dcp1.yaml "$plans/smollm2_tp1_dcp2_i16_gloo.yaml" \
    "$plans/smollm2_tp1_dcp2_i16_shm.yaml" \
    --input-len "${INPUT_LEN:-512}" --output-len 128 --num-prompts 32 --concurrency 8 \
    --seed 0 --warmup 2 --output "$out"
