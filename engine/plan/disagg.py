"""P/D plans: a decode plan whose `disagg` section names its prefill plan. The pair is checked together (same model
and KV cache, every decode rank's KV heads held by some prefill rank, ports, timeouts, the transport available),
and each piece of the deployment resolves to an ordinary plan plus its role (`instance`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine import devices
from engine.attention.kv_layout import HEAD_MAJOR_BACKENDS
from engine.checkpoints.model_info import dtype_bytes
from engine.dcp import DcpSpec
from engine.errors import UserError
from engine.kv_transfer.handles import LEASE_MARGIN_S, KVRole
from engine.kv_transfer.summary import HandoffSide, HandoffSummary, summarize
from engine.parallel_layout import kv_head_sources
from engine.plan.loader import COMMAND_LINE, LoadedPlan
from engine.plan.resolved import DisaggPlan, ResolvedPlan
from engine.plan.schema import CONNECTORS, FAILURE_POLICIES, DisaggSection
from engine.plan.validation import PlanCheck, PlanProblems

_SAME_MODEL = (
    "architecture",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "is_mla",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "vocab_size",
)


def prefill_file(loaded: LoadedPlan) -> Path:
    """The prefill plan's file: relative to the plan file that names it (to the working directory when an override
    does)."""
    file, _ = loaded.where("disagg.prefill")
    base = Path.cwd() if file == COMMAND_LINE else Path(file).parent
    return (base / loaded.plan.disagg.prefill).expanduser()


def check_pair(problems: PlanProblems, res: ResolvedPlan, prefill: PlanCheck) -> DisaggPlan:
    """Every problem of a P/D plan's pair (the prefill plan's own problems listed under its name)."""
    section = res.plan.disagg
    for e in prefill.problems.errors:
        problems.error("disagg.prefill", f"prefill plan {prefill.name}: {e}")
    for note in prefill.problems.notes:
        problems.notes.append(f"prefill plan {prefill.name}: {note}")
    for warning in prefill.problems.warnings:
        problems.warnings.append(f"prefill plan {prefill.name}: {warning}")
    _check_section(problems, res, section)
    other = prefill.resolved
    if other is not None and other.plan.disagg.prefill is not None:
        problems.error("disagg.prefill", f"prefill plan {prefill.name} is itself a P/D plan; name a plain plan")
    if other is not None and prefill.valid:
        _check_models(problems, res, other)
    calibrating = [side for side, r in (("prefill", other), ("decode", res)) if r and r.plan.cache.calculate_kv_scales]
    if calibrating:
        problems.error(
            "cache.calculate_kv_scales",
            f"cache.calculate_kv_scales is set on the {' and '.join(calibrating)} side: each instance would calibrate "
            "its own fp8 scales, and the decode side must read the prefill side's KV with the scales it was stored "
            "with; drop it on both (both then use the checkpoint's k_scale/v_scale, else 1.0)",
        )
    from engine.kv_transfer import transport  # not at the top: only P/D plans look for the transport

    reason = transport.unavailable_reason()
    if reason is not None:
        problems.error("disagg.connector", f"disagg.connector={section.connector}: {reason}")
    return DisaggPlan(section, prefill.name, other if prefill.valid else None)


def _check_section(problems: PlanProblems, res: ResolvedPlan, s: DisaggSection) -> None:
    if s.connector not in CONNECTORS:
        problems.error("disagg.connector", f"disagg.connector={s.connector!r} is not one of {', '.join(CONNECTORS)}")
    if s.kv_role not in (None, "kv_consumer"):
        problems.error(
            "disagg.kv_role",
            f"kv_transfer_config.kv_role={s.kv_role!r}: a plan with a disagg section is the decode side "
            "(kv_consumer); the role an instance plays comes from `dcpctl run --role`",
        )
    if s.failure_policy not in FAILURE_POLICIES:
        problems.error(
            "disagg.failure_policy",
            f"disagg.failure_policy={s.failure_policy!r} is not one of {', '.join(FAILURE_POLICIES)}",
        )
    ports = {
        "serve.port": res.plan.serve.port,
        "disagg.prefill_port": s.prefill_port,
        "disagg.decode_port": s.decode_port,
    }
    for key, port in ports.items():
        if key != "serve.port" and not 0 <= port <= 65535:
            problems.error(key, f"{key}={port} is not a port number (0 picks a free one)")
    seen: dict[int, str] = {}
    for key, port in ports.items():
        if port and port in seen:
            problems.error(
                key, f"{key}={port} is also {seen[port]}; the router and both instances need their own ports"
            )
        seen.setdefault(port, key)
    if s.lease_s <= 0 or s.transfer_timeout_s <= 0:
        problems.error("disagg.lease_s", "disagg.lease_s and disagg.transfer_timeout_s must be > 0 seconds")
    elif s.transfer_timeout_s + LEASE_MARGIN_S >= s.lease_s:
        problems.error(
            "disagg.transfer_timeout_s",
            f"disagg.transfer_timeout_s={s.transfer_timeout_s:g} must be more than {LEASE_MARGIN_S:g} s below "
            f"disagg.lease_s={s.lease_s:g} (the prefill side must keep the blocks for as long as a pull may take)",
        )
    if s.max_restarts < 0:
        problems.error(
            "disagg.max_restarts",
            f"disagg.max_restarts={s.max_restarts} must be >= 0 (0: a dead instance ends the run)",
        )
    if s.max_pulls_per_step < 1:
        problems.error("disagg.max_pulls_per_step", f"disagg.max_pulls_per_step={s.max_pulls_per_step} must be >= 1")
    for key in ("prefill_url", "decode_url"):
        url = getattr(s, key)
        if url is not None and not url.startswith(("http://", "https://")):
            problems.error(f"disagg.{key}", f"disagg.{key}={url!r} must be an http:// or https:// URL")


def _check_models(problems: PlanProblems, res: ResolvedPlan, prefill: ResolvedPlan) -> None:
    mine, theirs = res.model, prefill.model
    if mine is None or theirs is None:
        return
    diffs = [
        f"{k} {getattr(theirs, k)} there, {getattr(mine, k)} here"
        for k in _SAME_MODEL
        if getattr(mine, k) != getattr(theirs, k)
    ]
    if diffs:
        problems.error(
            "disagg.prefill", f"the prefill plan runs another model ({'; '.join(diffs)}); use the same model"
        )
        return
    if prefill.cache_dtype != res.cache_dtype:
        problems.error(
            "cache.dtype",
            f"the KV cache dtype differs: {prefill.cache_dtype} on the prefill side, {res.cache_dtype} here; "
            "set the same cache.dtype on both",
        )
    if prefill.device != res.device:
        problems.error("launch.device", f"the prefill plan runs on {prefill.device}, this one on {res.device}")
    if prefill.dtype != res.dtype:
        problems.warnings.append(
            f"model.dtype differs ({prefill.dtype} prefill, {res.dtype} decode): tokens may differ from the "
            "colocated plan"
        )
    if (prefill.max_model_len or 0) < (res.max_model_len or 0):
        problems.error(
            "model.max_model_len",
            f"the prefill plan's max_model_len {prefill.max_model_len} is below this plan's {res.max_model_len}: "
            "prompts this side takes would be refused there; raise it there or lower it here",
        )
    if prefill.layout is not None and res.layout is not None:
        for rank in range(res.layout.world_size):
            try:
                kv_head_sources(prefill.layout, res.layout, rank)
            except ValueError as exc:
                problems.error("parallel.tp", f"{exc}; choose layouts whose KV heads match")
    local = prefill.local_world_size + res.local_world_size
    if res.device == "cpu" and local > devices.cpu_cores():
        problems.warnings.append(
            f"{local} ranks of both instances on {devices.cpu_cores()} CPU cores: they share cores (fine for "
            "correctness, slow for speed)"
        )


def instance(res: ResolvedPlan, role: str) -> tuple[ResolvedPlan, KVRole]:
    """One instance of a P/D deployment as a plan of its own (serving on its port) and its role."""
    pd = res.disagg
    s = pd.section
    if role == "prefill":
        if pd.prefill is None:
            raise UserError(f"plan {res.name}: its prefill plan {pd.prefill_name} cannot run here")
        plan, port = pd.prefill, s.prefill_port
        kv_role = KVRole("prefill", lease_s=s.lease_s)
    else:
        if not s.prefill_url:
            raise UserError("--role decode needs disagg.prefill_url (where the prefill instance answers)")
        plan, port = res, s.decode_port
        kv_role = KVRole(
            "decode",
            transfer_timeout_s=s.transfer_timeout_s,
            failure_policy=s.failure_policy,
            max_pulls_per_step=s.max_pulls_per_step,
            measure_raw=s.measure_raw,
            prefill_url=s.prefill_url,
        )
    # both instances answer to the deployment's model name (the router passes requests on as they come)
    serve = dataclasses.replace(plan.plan.serve, port=port, model_name=res.plan.serve.model_name or res.name)
    return dataclasses.replace(plan, plan=dataclasses.replace(plan.plan, serve=serve)), kv_role


def handoff_side(res: ResolvedPlan) -> HandoffSide:
    """One side of the hand-off as the layouts and the cache geometry see it (a plan with a layout)."""
    info, c = res.model, res.plan.cache
    dim = info.kv_lora_rank + info.qk_rope_head_dim if info.is_mla else info.head_dim
    return HandoffSide(
        res.name,
        res.layout,
        DcpSpec(c.block_size, res.plan.parallel.interleave, res.plan.parallel.dcp),
        layers=info.num_layers,
        kinds=1 if info.is_mla else 2,
        head_bytes=dim * dtype_bytes(res.cache_dtype),
        head_major=res.backend in HEAD_MAJOR_BACKENDS,
    )


def handoff_summary(res: ResolvedPlan, lengths: tuple[int, ...] = (512, 2048)) -> HandoffSummary | None:
    """What the hand-off of this P/D plan costs per decode rank (None when either side has no layout)."""
    pd = res.disagg
    if pd is None or pd.prefill is None or pd.prefill.layout is None or res.layout is None:
        return None
    return summarize(handoff_side(pd.prefill), handoff_side(res), lengths)
