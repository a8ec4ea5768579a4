"""Start a plan's OpenAI-compatible server as a subprocess, wait for health, stop it: what evals launches the plans
it measures with. The class lives with the engine's hosting (`engine.serving.plan_server`), where a P/D deployment
starts its prefill and decode instances with it too."""

from engine.serving.plan_server import DEFAULT_HEALTH_TIMEOUT_S, PlanServer, ServerStartError, sigterm_interrupts

__all__ = ["DEFAULT_HEALTH_TIMEOUT_S", "PlanServer", "ServerStartError", "sigterm_interrupts"]
