#!/usr/bin/env bash
# Issue 19's measured run: SmolLM2-135M-Instruct on this CPU, tp1/dcp1 against tp1/dcp2 (interleave 16) with each
# dense placement (parallel.dense: replicated | sharded) and each DCP combine (parallel.dcp_comm_backend:
# ag_rs | a2a), all launched in turn in one `dcpctl bench` run, so the ratios compare like with like.
#
#   bash benchmarks/bench_dense_placement.sh [OUTPUT_DIR] [INPUT_LEN] [NUM_PROMPTS] [KEY=VALUE ...]
#
# defaults: runs/bench_dense 512 32; KEY=VALUE overrides apply to every target (input 4096 needs
# model.max_model_len=4352 and, for 8 sequences in flight without preemption at dcp 1, cache.memory=2GiB).
#
# The dcp2 variants are written to OUTPUT_DIR/plans (each extends plans/cpu/smollm2_tp1_dcp2_i16.yaml). Run it on a
# quiet machine: the figures are wall-clock timings on shared cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/bench_dense}"
input_len="${2:-512}"
num_prompts="${3:-32}"
overrides=("${@:4}")
dcpctl="${DCPCTL:-.venv/bin/dcpctl}"

mkdir -p "$out/plans"
base="$(pwd)/plans/cpu/smollm2_tp1_dcp2_i16.yaml"
targets=(plans/cpu/smollm2_tp1_dcp1.yaml)
for dense in replicated sharded; do
    for comm in ag_rs a2a; do
        plan="$out/plans/dcp2_${dense}_${comm}.yaml"
        printf 'base: %s\nname: dcp2_%s_%s\nparallel: {dense: %s, dcp_comm_backend: %s}\n' \
            "$base" "$dense" "$comm" "$dense" "$comm" >"$plan"
        targets+=("$plan")
    done
done

"$dcpctl" model pull smollm2-135m-instruct >/dev/null
exec "$dcpctl" bench "${targets[@]}" "${overrides[@]}" \
    --input-len "$input_len" --output-len 128 --num-prompts "$num_prompts" --concurrency 8 \
    --seed 0 --warmup 2 --output "$out"
