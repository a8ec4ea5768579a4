#!/usr/bin/env bash
# Issue 7's measured run: SmolLM2-135M-Instruct on this CPU, tp1/dcp1 vs tp1/dcp2 (interleave 1 and 64), input 512 /
# output 128 tokens, 32 prompts at concurrency 8, with HF transformers generate as the reference column.
#
#   bash benchmarks/bench_smollm2.sh [OUTPUT_DIR]          # default runs/bench_smollm2
#   VLLM_URL=http://127.0.0.1:8001 bash benchmarks/bench_smollm2.sh
#
# With VLLM_URL set, that OpenAI-compatible endpoint is measured as one more column. It must serve the same model
# folder (`dcpctl model pull smollm2-135m-instruct` prints it) in float32, e.g. vLLM's CPU build in its own venv:
#   VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 vllm serve "$MODEL_DIR" --dtype float32 --port 8001
# Run it on a quiet machine: the numbers are wall-clock timings on 2 shared cores. The table, bench.json,
# bench.md, throughput.png and tpot.png land in OUTPUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/bench_smollm2}"
dcpctl="${DCPCTL:-.venv/bin/dcpctl}"

targets=(
    plans/cpu/smollm2_tp1_dcp1.yaml
    plans/cpu/smollm2_tp1_dcp2_i1.yaml
    plans/cpu/smollm2_tp1_dcp2_i64.yaml
)
if [ -n "${VLLM_URL:-}" ]; then
    targets+=("$VLLM_URL")
else
    echo "VLLM_URL is not set: no vLLM column (vLLM was not run)" >&2
fi

"$dcpctl" model pull smollm2-135m-instruct >/dev/null
exec "$dcpctl" bench "${targets[@]}" \
    --input-len 512 --output-len 128 --num-prompts 32 --concurrency 8 \
    --seed 0 --warmup 2 --hf --output "$out"
