"""`export_plan`: a plan exported to the engine named (the per-engine modules build it)."""

from __future__ import annotations

from engine.errors import UserError
from engine.peers.export import ENGINES, Export, PlanFacts
from engine.peers.sglang_export import sglang_export
from engine.peers.trtllm_export import trtllm_export
from engine.peers.vllm_export import vllm_export

_BUILDERS = {"vllm": vllm_export, "sglang": sglang_export, "trtllm": trtllm_export}


def export_plan(engine: str, facts: PlanFacts) -> Export:
    """The plan exported to `engine` (one of ENGINES)."""
    if engine not in _BUILDERS:
        raise UserError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    return _BUILDERS[engine](facts)
