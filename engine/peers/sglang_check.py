"""Find the installed SGLang (a venv's python) and check an exported `python -m sglang.launch_server` line against
its own argument parser and server-argument validation, in a subprocess, without starting a server
(`sglang_shim.py check`). SGLang's flags change between releases; this says which release accepted them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from engine.peers.installed import Verdict, python_of_script, run_check_shim, stand_in_model

SHIM = Path(__file__).with_name("sglang_shim.py")
PYTHON_ENV = "DCPCTL_SGLANG_PYTHON"


def find_sglang_python(explicit: str | None = None) -> str | None:
    """The python of the venv that has SGLang: `explicit`, else $DCPCTL_SGLANG_PYTHON, else the interpreter of the
    `sglang` script on PATH (its #! line); None when there is none."""
    return explicit or os.environ.get(PYTHON_ENV) or python_of_script("sglang")


def check_launch_args(python: str, argv: list[str], env: dict[str, str]) -> Verdict:
    """SGLang's verdict on an exported `python -m sglang.launch_server ARGS` (argv as exported)."""
    args = list(argv[3:])
    with tempfile.TemporaryDirectory(prefix="dcpctl-sglang-check-") as folder:
        if "--model-path" in args:
            at = args.index("--model-path") + 1
            args[at] = stand_in_model(args[at], Path(folder))
        return run_check_shim("SGLang", python, SHIM, args, env, PYTHON_ENV)
