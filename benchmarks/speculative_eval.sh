#!/usr/bin/env bash
# Issue 36's eval: `dcpctl eval gsm8k --compare` on SmolLM2-135M-Instruct, a plan without speculation against the
# same plan with ngram k = 2, 4 and 8 (text agreement, every difference classified by the tie-flip classifier; wall
# time; acceptance per target).
#
#   LAYOUT=tp1_dcp1 LIMIT=100 bash benchmarks/speculative_eval.sh [OUTPUT_DIR]   # default runs/speculative_eval_$LAYOUT
#   LAYOUT=tp1_dcp2_i16 ...                                                     # the dcp2 interleave-16 variants
#   KS="2 8" NUM_CONCURRENT=1 ...                                               # only these k (default 2 4 8)
#
# The k = 2 and k = 8 plans are the shipped k = 4 plan (`base:`) with num_speculative_tokens changed, written into
# OUTPUT_DIR/plans. Each target is evaluated in its own run (under HEAVY_LOCK when set, e.g. /tmp/dcpctl-heavy.lock,
# so one hold stays short), then one more run with --resume reuses them all and writes the comparison. lm-eval sends
# NUM_CONCURRENT (default 4) requests at once: the shipped ngram plans stop proposing above a batch of 4, so this
# measures speculation switched on. Data: GSM8K's test/train jsonl in DATA_DIR (else $DCPCTL_GSM8K_DIR / the hub).
set -euo pipefail
cd "$(dirname "$0")/.."
layout="${LAYOUT:-tp1_dcp1}"
out="$(realpath -m "${1:-runs/speculative_eval_$layout}")"
dcpctl="${DCPCTL:-.venv/bin/dcpctl}"
plans="$out/plans"
mkdir -p "$plans"

base="plans/cpu/smollm2_$layout.yaml"
shipped="$PWD/plans/cpu/smollm2_${layout}_ngram4.yaml"
targets=("$base")
for k in ${KS:-2 4 8}; do
    plan="$plans/smollm2_${layout}_ngram$k.yaml"
    printf 'base: %s\nname: smollm2_%s_ngram%s\nspeculative_config:\n  num_speculative_tokens: %s\n' \
        "$shipped" "$layout" "$k" "$k" >"$plan"
    targets+=("$plan")
done

args=(--limit "${LIMIT:-100}" --num-concurrent "${NUM_CONCURRENT:-4}" --output "$out" --resume)
if [ -n "${DATA_DIR:-}" ]; then
    args+=(--data-dir "$DATA_DIR")
fi
"$dcpctl" model pull smollm2-135m-instruct >/dev/null
for target in "${targets[@]}"; do
    if [ -n "${HEAVY_LOCK:-}" ]; then
        flock "$HEAVY_LOCK" "$dcpctl" eval gsm8k --compare "$target" "${args[@]}" >/dev/null
    else
        "$dcpctl" eval gsm8k --compare "$target" "${args[@]}" >/dev/null
    fi
done
exec "$dcpctl" eval gsm8k --compare "${targets[@]}" "${args[@]}"
