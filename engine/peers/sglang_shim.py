"""Runs inside the SGLang venv (no dcpctl imports): `python sglang_shim.py check ARGS...` checks
`python -m sglang.launch_server ARGS` against that SGLang's own argument parser and server-argument validation
(`prepare_server_args`: the parser, then ServerArgs' checks) without starting a server, and prints one line
`DCPCTL-SGLANG-CHECK {"version": ..., "ok": ..., "error": ..., "stage": ...}`.
"""

import argparse
import importlib.metadata as metadata
import json
import sys

MARKER = "DCPCTL-SGLANG-CHECK "


class _ParserError(Exception):
    """argparse's complaint, raised instead of printing the usage and exiting."""


def _raise(_parser: argparse.ArgumentParser, message: str) -> None:
    raise _ParserError(message)


def check(args: list[str]) -> dict:
    """SGLang's verdict on `launch_server ARGS`: its parser, then its server-argument checks."""
    from sglang.srt.server_args import prepare_server_args

    verdict = {"version": metadata.version("sglang"), "ok": False, "error": "", "stage": "parser"}
    argparse.ArgumentParser.error = _raise
    try:
        prepare_server_args(args)
    except _ParserError as exc:
        verdict["error"] = str(exc)
        return verdict
    except BaseException as exc:  # ServerArgs' own checks raise their own errors
        verdict["stage"] = "config"
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        verdict["error"] = lines[-1] if lines else type(exc).__name__
        return verdict
    verdict["ok"] = True
    return verdict


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode != "check":
        raise SystemExit(f"unknown mode {mode!r}: only `check` is supported")
    print(MARKER + json.dumps(check(args)), flush=True)


if __name__ == "__main__":
    main()
