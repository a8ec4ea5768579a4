"""What the checks of an export against an installed engine (vLLM, SGLang) share: the python behind an engine's
console script, a model folder their config validation can read here, and running a check shim in that python."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

CHECK_TIMEOUT_S = 300.0
_MODEL_TYPES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


def python_of_script(script_name: str) -> str | None:
    """The interpreter of the console script `script_name` on PATH (its #! line); None when there is none."""
    script = shutil.which(script_name)
    if script is None:
        return None
    try:
        first = Path(script).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[2:].strip() if first.startswith("#!") else None


def stand_in_model(model: str, folder: Path) -> str:
    """A folder an engine's config validation can read for `model`: the model itself when it is a folder here, else
    `folder` holding the config.json facts dcpctl ships for it (the model unchanged when there are none)."""
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


@dataclass(frozen=True)
class Verdict:
    """What an installed engine said about one exported command."""

    engine: str  # vLLM | SGLang
    version: str
    ok: bool
    error: str  # the engine's own words, when not ok
    stage: str  # parser | config: how far the check got


def run_check_shim(engine: str, python: str, shim: Path, args: list[str], env: dict[str, str], env_var: str) -> Verdict:
    """Run `python shim check ARGS` (in the engine's venv) and read its one-line JSON verdict after `MARKER`."""
    marker = f"DCPCTL-{engine.upper()}-CHECK "
    try:
        done = subprocess.run(
            [python, str(shim), "check", *args],
            capture_output=True,
            text=True,
            env={**os.environ, **env, "HF_HUB_OFFLINE": "1"},
            timeout=CHECK_TIMEOUT_S,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"the {engine} check ({python}) took over {CHECK_TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise UserError(f"cannot run the {engine} python {python} ({exc}); set ${env_var}") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"the {engine} check with {python} failed before a verdict ({why})")
    data = json.loads(lines[-1].split(" ", 1)[1])
    return Verdict(engine, data["version"], data["ok"], data["error"], data["stage"])
