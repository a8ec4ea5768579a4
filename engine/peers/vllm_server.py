"""A plan served by vLLM (`engine.name: vllm`): `vllm serve` with the plan's exported flags, started, waited for and
stopped exactly like a dcpctl server (`PlanServer`: its own session, so vLLM's API server, EngineCore and worker
processes all go with it), through `vllm_shim.py serve` in the vLLM venv.

`vllm_problems` says, before anything launches, why a plan cannot be served so: no vLLM found, a python that
does not import vllm, or a layout the export says vLLM cannot run.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import UserError
from engine.peers.export import Instance, PlanFacts, plan_facts
from engine.peers.exporters import export_plan
from engine.peers.vllm_check import PYTHON_ENV, SHIM, find_vllm_python, vllm_version
from engine.serving.plan_server import DEFAULT_HEALTH_TIMEOUT_S, PlanServer


def vllm_instance(plan: str, overrides: list[str]) -> tuple[PlanFacts, Instance, str]:
    """The plan's facts, its one `vllm serve` instance and the vLLM python; a UserError says why there is none."""
    facts = plan_facts(plan, overrides)
    export = export_plan("vllm", facts)
    if not export.runnable:
        reasons = "; ".join(f"{g.message} [{g.reference}]" for g in export.gaps if g.blocking)
        raise UserError(
            f"plan {facts.plan.name}: vLLM cannot run it ({reasons}); use engine.name=dcpctl for this layout"
        )
    if len(export.instances) != 1:
        raise UserError(
            f"plan {facts.plan.name}: dcpctl launches one `vllm serve` per target, and vLLM's P/D needs "
            f"{len(export.instances)} instances joined by NIXL and a proxy of its own; start those from `dcpctl plan "
            f"export {plan} --to vllm` and give eval their URL, or use engine.name=dcpctl"
        )
    python = find_vllm_python(facts.plan.engine.python)
    if python is None:
        raise UserError(
            f"plan {facts.plan.name}: engine.name=vllm but no vLLM was found; set engine.python or ${PYTHON_ENV} to "
            "the python of a venv with vllm, or put its `vllm` on PATH"
        )
    try:
        vllm_version(python)
    except UserError as exc:
        raise UserError(f"plan {facts.plan.name}: {exc}") from None
    return facts, export.instances[0], python


def vllm_problems(plan: str, overrides: list[str]) -> list[str]:
    """Why the plan cannot be served by vLLM here (empty when it can)."""
    try:
        vllm_instance(plan, overrides)
    except UserError as exc:
        return [str(exc)]
    return []


class VllmServer(PlanServer):
    """`vllm serve` for a plan with engine.name=vllm, on a free port (or serve.port's), as a PlanServer."""

    def __init__(
        self,
        plan: str,
        overrides: list[str] | None = None,
        *,
        host: str = "127.0.0.1",
        health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
        log_path: Path | None = None,
        label: str | None = None,
    ) -> None:
        facts, self.instance, self.python = vllm_instance(plan, list(overrides or []))
        timeout = facts.plan.engine.startup_timeout_s or health_timeout_s
        super().__init__(plan, overrides, host=host, health_timeout_s=timeout, log_path=log_path, label=label)
        self.env = self._environment(facts)

    def _environment(self, facts: PlanFacts) -> dict[str, str]:
        # the project's PYTHONPATH is not the vLLM venv's business
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(self.instance.env)
        if facts.device == "cpu":
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        return env

    @property
    def command(self) -> list[str]:
        """The vLLM python running `vllm serve` (the shim) with the exported flags, host and port set here."""
        args = list(self.instance.argv[2:])
        for flag, value in (("--host", self.host), ("--port", str(self.port))):
            args[args.index(flag) + 1] = value
        return [self.python, str(SHIM), "serve", *args]
