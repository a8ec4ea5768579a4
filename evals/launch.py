"""Start a plan's OpenAI-compatible server as a subprocess, wait for health, stop it: what evals launches the plans
it measures with. The class lives with the engine's hosting (`engine.serving.plan_server`), where a P/D deployment
starts its prefill and decode instances with it too."""

import math

from engine.errors import UserError
from engine.serving.plan_server import DEFAULT_HEALTH_TIMEOUT_S, PlanServer, ServerStartError, sigterm_interrupts

__all__ = ["DEFAULT_HEALTH_TIMEOUT_S", "PlanServer", "ServerStartError", "check_health_timeout", "sigterm_interrupts"]


def check_health_timeout(seconds: float) -> None:
    """A UserError unless --health-timeout is a positive, finite number of seconds."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise UserError(f"--health-timeout must be a positive number of seconds (got {seconds})")
