"""What every rank of a served plan runs: rank 0 serves the OpenAI API, the other ranks follow its steps.

The followers never import the server (FastAPI, uvicorn, the OpenAI app): ~0.3 s of CPU each that a plan's start
would otherwise pay once per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_transfer.handles import KVRole
    from engine.plan.resolved import ResolvedPlan


def serve_plan(resolved: ResolvedPlan, kv_role: KVRole | None = None) -> None:
    """Every rank of `dcpctl run PLAN`: rank 0 serves the API; the other ranks follow its steps until it stops.
    `kv_role`: the instance's part in a P/D deployment."""
    from engine.core.startup import start_engine

    engine = start_engine(resolved, shield_followers=True, kv_role=kv_role)
    if engine is None:
        return
    from engine.serving.background import configure_logging
    from engine.serving.hosting import serve_engine

    serve = resolved.plan.serve
    configure_logging()
    serve_engine(engine, serve.host, serve.port, serve.model_name or resolved.name)
