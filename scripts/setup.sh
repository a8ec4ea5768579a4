#!/usr/bin/env bash
# Make .venv from nothing: torch 2.13.0 first (the CPU wheel; an unpinned torch may pull a
# multi-GB CUDA build), then dcpctl with its test extra. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m engine.kernels.cpu_kernels  # compile the engine's CPU kernels once (cached)
.venv/bin/python -m engine.kernels.shm_kernels  # and the shared-memory collectives
echo "dcpctl installed in $(pwd)/.venv (activate with: . .venv/bin/activate)"
