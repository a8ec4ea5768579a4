#!/usr/bin/env bash
# The one prepared GPU check for the Triton / flash-attn attention backends (issue 6), for an H200-class machine.
#
#   bash benchmarks/gpu_check.sh                 on the GPU machine, from anywhere (it cds to the repo root)
#   bash benchmarks/gpu_check.sh --fetch-wheels  here, with PyPI: pure-Python wheels the GPU image may lack, into
#                                                .whl/ (git-ignored); carry .whl to the GPU machine with the tree
#   bash benchmarks/gpu_check.sh --cpu-smoke     here: the same stages on CPU, tiny (checks the script itself)
#   bash benchmarks/gpu_check.sh --quick         on the GPU machine: environment, tests and equivalence only (~2 min)
#   bash benchmarks/gpu_check.sh --e2e           on the GPU machine: environment and the end-to-end stage only (~4 min)
#   bash benchmarks/gpu_check.sh --skip-e2e      on the GPU machine: every stage but the end-to-end one (~2.5 min)
#
# Stages (each under its own timeout; ~2.5 minutes on an H200 before the end-to-end stage): environment (a python with
# CUDA torch + triton; missing packages from .whl/ or pip; flash-attn only if a wheel installs, else skipped with a
# note), the kernel and backend tests on CUDA (pytest -m gpu: attention, fused MoE, CUDA graphs), tiny-model greedy
# equivalence per backend (and the torch backend against HF), the decode bandwidth benchmark
# (benchmarks/attention_bench.py), a Triton tile sweep, and the end-to-end decode (benchmarks/e2e_decode.py: random
# DeepSeek-V2-Lite- and Llama-3.1-8B-shaped bf16 checkpoints generated on the GPU, batch 1/8/64 x input 2k/32k, CUDA
# graphs on vs off, tok/s against the HBM roofline; each checkpoint is deleted after its run, so the disk needs ~32 GB
# free, not 48). Results go to $OUT (default runs/gpu_check/).
# One GPU runs one rank: the tp2 dcp2 whole-model check is the CPU test (tests/test_triton_backend.py, multiproc);
# here the DCP-sharded math runs on CUDA in test_gpu_backend_matches_torch (dcp 2 per-rank + merge).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  # transformers: the project's pin (the GPU image ships an older one); omegaconf: the plan loader
  python3 -m pip download --no-deps --only-binary=:all: -d .whl "transformers==5.24.*" "omegaconf==2.4.0"
  ls -la .whl
  exit 0
fi

SMOKE=0
QUICK=0
E2E=1    # the end-to-end stage
OTHERS=1 # the stages before it
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
[ "${1:-}" = "--quick" ] && QUICK=1 && E2E=0  # the correctness stages only (a rerun after a fix)
[ "${1:-}" = "--e2e" ] && OTHERS=0
[ "${1:-}" = "--skip-e2e" ] && E2E=0
OUT=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
START=$(date +%s)
FAILED=()
stage() { echo; echo "=== [$(($(date +%s) - START)) s] $*"; }
record() { # record NAME RC
  if [ "$2" -ne 0 ]; then FAILED+=("$1 (exit $2)"); echo "--- $1: FAILED (exit $2)"; else echo "--- $1: ok"; fi
}

stage "environment"
PY=${PYTHON:-python3}
if [ "$SMOKE" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA torch in $PY: making .venv-gpu and installing torch (needs a package index)"
  python3 -m venv "$ROOT/.venv-gpu" && PY=$ROOT/.venv-gpu/bin/python
  timeout 300 "$PY" -m pip install -q --retries 0 --timeout 10 torch triton pytest pyyaml || true
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "FATAL: no python with a CUDA build of torch; set PYTHON=... to one"; exit 2
  fi
fi
export PYTHONUNBUFFERED=1
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_site \
    "$ROOT"/.whl/*.whl && export PYTHONPATH=/tmp/gpu_site
  if ! "$PY" -c "import transformers" 2>/dev/null; then  # its pinned deps may be newer than the image's
    echo "note: the carried transformers does not import here; using the image's"
    rm -rf /tmp/gpu_site/transformers /tmp/gpu_site/transformers-*
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
MISSING=$("$PY" - <<'EOF'
import importlib.util
names = ["omegaconf", "typer", "rich", "yaml", "safetensors", "tokenizers", "transformers", "pytest", "triton"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$MISSING" ]; then
  echo "missing: $MISSING; trying pip (works only with a package index)"
  PIPNAMES=$(echo "$MISSING" | sed 's/\byaml\b/pyyaml/')
  # shellcheck disable=SC2086
  timeout 60 "$PY" -m pip install -q --retries 0 --timeout 5 $PIPNAMES || echo "note: pip could not install: $PIPNAMES"
fi
if [ "$SMOKE" = 0 ] && ! "$PY" -c "import flash_attn" 2>/dev/null; then
  # a prebuilt wheel only: a source build of flash-attn takes far longer than this whole check
  if timeout 60 "$PY" -m pip install -q --retries 0 --timeout 5 --only-binary=:all: flash-attn >/dev/null 2>&1; then
    echo "flash-attn installed from a wheel"
  else
    echo "note: flash-attn not installed (no index or no wheel for this torch/CUDA): its rows are skipped"
  fi
fi
"$PY" - <<'EOF'
import importlib.util, platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for name in ("flash_attn", "transformers", "omegaconf"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(name, "missing")
    else:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv

if [ "$OTHERS" = 1 ]; then
stage "kernel and backend tests (pytest -m gpu)"
if [ "$SMOKE" = 1 ]; then MARK="not gpu and not multiproc"; else MARK="gpu"; fi
timeout 180 "$PY" -m pytest tests/test_triton_kernels.py tests/test_triton_backend.py tests/test_fused_moe.py \
  tests/test_cuda_graphs.py -m "$MARK" -q -rs \
  -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
record "pytest -m '$MARK'" "${PIPESTATUS[0]}"

stage "tiny models: greedy tokens per backend vs the torch backend"
SMOKE=$SMOKE timeout 130 "$PY" - <<'EOF' 2>&1 | tee "$OUT/equivalence.md"
import importlib.util, os, sys, tempfile, time, traceback
from pathlib import Path

from engine import LLM, SamplingParams
from engine.checkpoints.tiny import make_tiny_checkpoint
from tests.oracle import hf_bf16_disagreements, hf_greedy, prompt_ids, write_plan

smoke = os.environ.get("SMOKE") == "1"
device = "cpu" if smoke else "cuda"
work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
lengths, new = ([3, 17, 40], 8) if smoke else ([3, 17, 40, 100, 333], 16)
prompts = prompt_ids(len(lengths), lengths, seed=3)
have_flash = importlib.util.find_spec("flash_attn") is not None and not smoke
models = {
    "llama kv2": make_tiny_checkpoint(work / "llama", "llama", num_kv_heads=2),
    "deepseek_v2 (MLA)": make_tiny_checkpoint(work / "mla", "deepseek_v2"),
}
# (model, dtype, block size, backends); fp32 must match the torch backend token for token (ieee dots);
# bf16 differs in rounding between kernels, so its rows report agreement with torch and, per backend, the prompts
# whose tokens HF bf16 (on CPU) rejects by the project's bf16 rule (tests/oracle.py: beyond HF's own noise). The
# MLA rows can be rejected there on any backend: the engine absorbs W_UK / W_UV into the query and output, so it
# rounds at other points than HF's expanded keys and values do (as vLLM's MLA does).
runs = []
for name in models:
    runs.append((name, "float32", 16, ["torch", "triton"]))
    flash = ["flash_attn"] if have_flash else []  # MLA: the flash backend hands its layers to Triton
    runs.append((name, "bfloat16", 256, ["torch", "triton", *flash]))
print("| model | dtype | block | backend | tokens equal to torch | max logprob diff before divergence |"
      " HF bf16 rule: prompts rejected | seconds |")
print("|---|---|---|---|---|---|---|---|")


def prefix_diff(a, b) -> float:
    """Largest logprob difference over the steps before the two token streams first differ."""
    worst = 0.0
    for x, y, s, t in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
        if s != t:
            break
        worst = max(worst, abs(x.logprob - y.logprob))
    return worst


failures = 0
for name, dtype, block, backends in runs:
    results = {}
    for backend in backends:
        plan = write_plan(work, models[name], {"launch.device": device, "model.dtype": dtype, "cache.block_size": block,
                                               "attention.backend": backend, "scheduler.max_num_batched_tokens": 64},
                          f"{backend}-{dtype}.yaml")
        t0 = time.time()
        try:
            with LLM(plan) as llm:
                outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=1))
        except Exception as exc:  # report and go on: one backend failing must not hide the others
            traceback.print_exc(limit=-6)  # where, in the log: the table row has only the message
            print(f"| {name} | {dtype} | {block} | {backend} | ERROR {type(exc).__name__}: {str(exc)[:120]} | | | |")
            failures += 1
            continue
        results[backend] = (outs, time.time() - t0)
    if "torch" not in results:
        continue
    ref = results["torch"][0]
    if dtype == "float32":  # the engine's whole CUDA path against the independent oracle (HF on CPU, fp32)
        hf = [hf_greedy(models[name], p, new)[0] for p in prompts]
        same = sum(a.token_ids == b for a, b in zip(ref, hf))
        print(f"| {name} | {dtype} | {block} | HF transformers (CPU) vs torch on {device} | {same}/{len(hf)} | | | |")
        failures += same != len(hf)
    for backend, (outs, secs) in results.items():
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs, ref))
        diff = max(prefix_diff(a, b) for a, b in zip(outs, ref))
        rejected = ""
        if dtype == "bfloat16":
            rejected = sum(bool(hf_bf16_disagreements(models[name], p, o.token_ids)) for p, o in zip(prompts, outs))
            rejected = f"{rejected}/{len(outs)}"
        print(f"| {name} | {dtype} | {block} | {backend} | {same}/{len(ref)} | {diff:.2e} | {rejected} | {secs:.1f} |")
        if dtype == "float32" and same != len(ref):
            failures += 1
sys.exit(1 if failures else 0)
EOF
record "tiny-model equivalence" "${PIPESTATUS[0]}"

if [ "$QUICK" = 0 ]; then
stage "decode attention bandwidth (benchmarks/attention_bench.py)"
if [ "$SMOKE" = 1 ]; then BENCH=(--device cpu --tiny --contexts 64 --batches 1); else BENCH=(); fi
timeout 150 "$PY" benchmarks/attention_bench.py "${BENCH[@]}" --out "$OUT"
record "attention_bench" "$?"

stage "Triton decode tile sweep (tuning data)"
timeout 50 "$PY" benchmarks/attention_bench.py "${BENCH[@]}" --sweep | tee "$OUT/triton_sweep.md"
record "tile sweep" "${PIPESTATUS[0]}"
fi
fi

if [ "$E2E" = 1 ]; then
stage "end to end: decode at real shapes, CUDA graphs on vs off (benchmarks/e2e_decode.py)"
if [ "$SMOKE" = 1 ]; then
  E2EARGS=(--tiny --batches 1 8 --inputs 64 256 --steps 3 --peak-tbs 0.05); E2ETIME=120
else
  E2EARGS=(); E2ETIME=270  # per model: generate (~30 s for 31 GB), load, capture, 2 x 6 cases, the MoE timing
fi
for MODEL in deepseek-v2-lite llama-3.1-8b-instruct; do
  timeout "$E2ETIME" "$PY" benchmarks/e2e_decode.py --model "$MODEL" --work "${E2E_WORK:-/tmp}" --out "$OUT" \
    "${E2EARGS[@]}" 2>&1 | tail -40
  record "e2e $MODEL" "${PIPESTATUS[0]}"
done
fi

stage "done"
ls -la "$OUT"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all stages passed"
