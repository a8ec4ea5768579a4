"""Per-rank entry point that torchrun starts: `python -m engine.worker --plan PLAN [--set K=V] JOB`.

Rank 0 drives (offline job or server); the other ranks follow its steps. A rank that fails writes
a one-line reason to `--error-dir` so the launching command can name the root cause.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from engine.errors import PEER_LOST, UserError
from engine.gc_pause import gc_paused
from engine.io_utils import atomic_write_text


def _write_error(error_dir: str | None, message: str) -> None:
    if error_dir:
        rank = os.environ.get("RANK", "0")
        atomic_write_text(
            Path(error_dir) / f"rank{rank}.json",
            json.dumps({"rank": int(rank), "time": time.time(), "message": message}),
        )


def run(argv: list[str] | None = None) -> None:
    """One rank under torchrun: run the job, then leave at once with its exit code.

    Leaving through os._exit skips interpreter finalization, where gloo's worker threads abort the process
    ("terminate called without an active exception") or hang it; every result is written and flushed by then.
    """
    code = _run_job(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _import_engine(serve: bool) -> None:
    """Import the engine with the GC paused, then frozen (`gc_paused`): rank 0 of a served plan also the server."""
    serves_api = serve and os.environ.get("RANK", "0") == "0"  # the other ranks follow rank 0's steps
    with gc_paused(freeze=True):
        for module in ("engine.llm", "engine.core.startup", *(("engine.serving.hosting",) if serves_api else ())):
            importlib.import_module(module)


def _run_job(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="engine.worker")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--error-dir")
    job = parser.add_mutually_exclusive_group(required=True)
    job.add_argument("--job-file")
    job.add_argument("--serve", action="store_true")
    parser.add_argument("--kv-role", choices=("prefill", "decode"), help="serve this instance of a P/D plan")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        _import_engine(args.serve)
        from engine.plan.checks import resolve_plan

        resolved = resolve_plan(args.plan, args.overrides)
        if args.serve:
            from engine.serving.ranks import serve_plan

            kv_role = None
            if args.kv_role:
                from engine.plan.disagg import instance

                resolved, kv_role = instance(resolved, args.kv_role)
            serve_plan(resolved, kv_role)
        else:
            from engine.llm import LLM
            from engine.offline import OfflineJob, run_offline

            llm = LLM(resolved)
            try:
                run_offline(llm, OfflineJob.load(Path(args.job_file)))
            finally:
                llm.close()
        return 0
    except UserError as exc:
        _write_error(args.error_dir, str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not exc.code:
            return 0  # a follower rank of LLM(...) after rank 0 closed it
        message = f"{type(exc).__name__}: {exc}"
        _write_error(args.error_dir, message)
        if any(s in message for s in PEER_LOST):  # another rank failed first: the launcher names it
            print(f"error: {message}", file=sys.stderr)
        else:
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    run()
