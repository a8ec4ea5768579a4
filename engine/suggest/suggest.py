"""Every layout the plan checks accept for a model on a cluster, ranked under an objective, with the reason each
rejected combination was rejected, and the plan YAML a suggestion writes.

Each candidate is a real plan (`engine.plan.schema.Plan`) run through `engine.plan.checks.check_plan` for the
cluster it names (not this machine's devices): what it accepts is what `plan validate` accepts, and a rejection's
reason is the check's own message. The KV budget per rank is what the device's memory leaves after the rank's
weights (`--kv-memory` fixes it); a suggestion writes it in bytes, so the engine allocates exactly the blocks shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine import dcp as dcp_math
from engine.checkpoints.model_info import dtype_bytes
from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.parallel_layout import divisors, kv_replication
from engine.placement.split import DENSE_PLACEMENTS, DensePlacement
from engine.placement.weights import weight_bytes
from engine.plan.checks import check_plan
from engine.plan.kv_sizing import format_bytes
from engine.plan.loader import LoadedPlan, plan_to_dict
from engine.plan.schema import DTYPES, ParallelSection, Plan
from engine.plan.validation import PlanCheck
from engine.suggest.figures import Cluster, DecodeStep, decode_step
from engine.suggest.models import PlannedModel

OBJECTIVES = ("capacity", "latency", "throughput")
MEMORY_FRACTION = 0.9  # of a device's memory for weights + KV; the rest for activations and the runtime
MULTI_NODE_PORT = 29500  # launch.master_port a multi-node plan needs (the same on every node; edit to taste)


@dataclass(frozen=True)
class Request:
    """What the user plans for."""

    model: PlannedModel
    cluster: Cluster
    context: int
    concurrency: int
    dtype: str = "auto"
    block_size: int = 64
    kv_memory: int | None = None  # bytes of KV per rank instead of what the memory leaves
    objective: str = "capacity"

    def __post_init__(self) -> None:
        if self.context < 1:
            raise UserError(f"--context {self.context} must be >= 1 token")
        if self.concurrency < 1:
            raise UserError(f"--concurrency {self.concurrency} must be >= 1 sequence")
        if self.block_size < 1:
            raise UserError(f"--block-size {self.block_size} must be >= 1 (e.g. 16 or 64)")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.objective not in OBJECTIVES:
            raise UserError(f"--optimize {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.cluster.devices < 1 or self.cluster.nodes < 1:
            raise UserError("--devices and --nodes must be >= 1")


@dataclass
class Candidate:
    """One combination of the grid: its plan, the check's verdict, and (accepted) its figures."""

    plan: Plan
    check: PlanCheck
    rejected: list[str] = field(default_factory=list)
    placement: DensePlacement | None = None
    weight_bytes_per_rank: int = 0
    copies: int = 1  # independent engines (data parallel) the cluster runs of this layout
    seqs_at_context: int = 0
    batch: int = 0  # sequences each engine decodes per step: its share of --concurrency, as far as it holds them
    step: DecodeStep | None = None
    concurrency: int = 1

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def accepted(self) -> bool:
        return not self.rejected

    @property
    def kv_bytes_per_token_per_rank(self) -> float:
        """KV bytes one rank stores per token of a sequence (its share over the DCP group)."""
        kv = self.check.resolved.kv
        return kv.bytes_per_token / kv.dcp

    @property
    def serves_concurrency(self) -> bool:
        """The `copies` engines hold the requested concurrent sequences at the requested context."""
        return self.copies * self.batch >= self.concurrency

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens per second of all `copies` engines at `batch` sequences each."""
        return self.copies * self.batch / self.step.seconds


@dataclass
class Suggestion:
    request: Request
    accepted: list[Candidate]
    rejected: list[Candidate]


def _ranking(objective: str, c: Candidate) -> tuple:
    kv = c.check.resolved.kv
    world = c.check.resolved.world_size
    simpler = (world, c.plan.parallel.dcp, -c.plan.parallel.interleave)  # ties: fewer ranks, then whole blocks
    if objective == "capacity":
        return (-kv.token_capacity, c.step.seconds, *simpler)
    if objective == "latency":
        return (not c.serves_concurrency, c.step.seconds, -kv.token_capacity, *simpler)
    return (not c.serves_concurrency, -c.tokens_per_s, c.step.seconds, *simpler)


DEFAULT_DENSE = ParallelSection.dense  # the placement a plan gets without parallel.dense


def _plan(req: Request, tp: int, dcp: int, interleave: int, dense: str, memory: str, nnodes: int) -> Plan:
    model = req.model
    stem = Path(model.plan_path).name.lower().replace(".", "_")
    name = (
        f"{stem}_tp{tp}_dcp{dcp}"
        + (f"_i{interleave}" if dcp > 1 else "")
        + ("_replicated" if dense != DEFAULT_DENSE else "")
    )
    plan = Plan(name=name, description=f"dcpctl plan suggest: {req.objective} at {req.context} tokens")
    plan.model.path = model.plan_path
    plan.model.dtype = req.dtype
    plan.model.max_model_len = req.context
    plan.parallel.tp, plan.parallel.dcp, plan.parallel.interleave = tp, dcp, interleave
    plan.parallel.dense = dense
    plan.cache.block_size = req.block_size
    plan.cache.memory = memory
    plan.scheduler.max_num_seqs = req.concurrency
    plan.launch.device = req.cluster.spec.kind
    plan.launch.nnodes = nnodes
    if nnodes > 1:
        plan.launch.master_port = MULTI_NODE_PORT
    return plan


def _check(req: Request, plan: Plan) -> PlanCheck:
    loaded = LoadedPlan(plan=plan, source=Path(f"{plan.name}.yaml"))
    return check_plan(loaded, model=req.model.info, devices_here=False)


def _kv_budget(req: Request, weights: int, local_ranks: int) -> int:
    """KV bytes per rank: --kv-memory, else the device's memory share left after the rank's weights."""
    if req.kv_memory is not None:
        return req.kv_memory
    spec = req.cluster.spec
    if spec.shared:  # one memory for the node's ranks, each holding its own weights
        return int((spec.memory_bytes * MEMORY_FRACTION - local_ranks * weights) / local_ranks)
    return int(spec.memory_bytes * MEMORY_FRACTION - weights)


def _evaluate(req: Request, tp: int, dcp: int, interleave: int, dense: str) -> Candidate | None:
    cluster = req.cluster
    info = req.model.info
    probe = _plan(req, tp, dcp, interleave, dense, "1GiB", 1)  # for the layout and dtype checks only
    first = _check(req, probe)
    res = first.resolved
    if res.layout is None:
        return Candidate(probe, first, [e.message for e in first.problems.errors])
    if dense != DEFAULT_DENSE and res.layout.replicas == 1:
        return None  # without replica ranks every placement is the same (tensor-parallel over the TP group)
    world = res.layout.world_size
    nnodes = cluster.nodes_of(world)
    if cluster.total % world:
        return Candidate(probe, first, [f"world size {world} does not divide the {cluster.total} devices"])
    if world > cluster.devices and world % cluster.devices:
        return Candidate(
            probe, first, [f"world size {world} spans nodes but is not a multiple of {cluster.devices} per node"]
        )
    placement = DensePlacement.build(res.layout, info, dense, res.plan.parallel.dcp_comm_backend)
    elem = dtype_bytes(res.dtype)
    weights = max(weight_bytes(placement, r, elem) for r in range(world))
    local = world // nnodes
    budget = _kv_budget(req, weights, local)
    if budget <= 0:
        spec = cluster.spec
        return Candidate(
            probe,
            first,
            [
                f"weights of {format_bytes(weights)} per rank leave no KV memory in {format_bytes(spec.memory_bytes)} "
                f"x {MEMORY_FRACTION:g} of a {spec.name} device; use more devices, a larger tp or a 16-bit dtype"
            ],
        )
    plan = _plan(req, tp, dcp, interleave, dense, f"{budget}B", nnodes)
    check = _check(req, plan)
    if check.problems.errors:
        return Candidate(plan, check, [e.message for e in check.problems.errors])
    kv = check.resolved.kv
    seqs = kv.num_blocks // dcp_math.blocks_needed(req.context, req.block_size, dcp)
    copies = 1 if cluster.spec.shared else cluster.total // world
    batch = max(1, min(-(-req.concurrency // copies), seqs))
    plan.scheduler.max_num_seqs = batch
    step = plan_step(check, cluster, batch, req.context)
    return Candidate(plan, check, [], placement, weights, copies, seqs, batch, step, req.concurrency)


def _grid(req: Request) -> list[tuple[int, int, int, str]]:
    info, total, block = req.model.info, req.cluster.total, req.block_size
    combos = []
    for tp in divisors(total):
        rep = kv_replication(tp, info.num_kv_heads, info.is_mla)
        for dcp in sorted(set(divisors(rep * total // tp)) | set(divisors(total))):
            interleaves = (1,) if dcp == 1 else sorted({1, block})
            for interleave in interleaves:
                for dense in DENSE_PLACEMENTS:
                    combos.append((tp, dcp, interleave, dense))
    return combos


def suggest(req: Request) -> Suggestion:
    """Check every combination of the grid and rank the accepted ones under the request's objective."""
    accepted, rejected = [], []
    for combo in _grid(req):
        candidate = _evaluate(req, *combo)
        if candidate is not None:
            (accepted if candidate.accepted else rejected).append(candidate)
    accepted.sort(key=lambda c: _ranking(req.objective, c))
    return Suggestion(req, accepted, rejected)


def plan_yaml(candidate: Candidate) -> str:
    """The candidate's plan as YAML `plan validate` accepts unchanged: the fields that differ from the defaults."""
    defaults = plan_to_dict(Plan())
    data = plan_to_dict(candidate.plan)
    lines = [
        f"# {candidate.name}: written by `dcpctl plan suggest`; token capacity "
        f"{candidate.check.resolved.kv.token_capacity}, {candidate.seqs_at_context} sequences at "
        f"{candidate.plan.model.max_model_len} tokens",
    ]
    return "\n".join(lines) + "\n" + yaml.safe_dump(_changed(data, defaults), sort_keys=False)


def _changed(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        default = defaults.get(key)
        if isinstance(value, dict):
            inner = _changed(value, default or {})
            if inner:
                out[key] = inner
        elif value != default or key == "path":
            out[key] = value
    return out


def write_plan(candidate: Candidate, path: str | Path) -> Path:
    """Write the candidate's plan YAML to `path` atomically (never half-written)."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"--write {target} is a folder; give a file such as {target / (candidate.name + '.yaml')}")
    return atomic_write_text(target, plan_yaml(candidate))


def plan_step(check: PlanCheck, cluster: Cluster, batch: float, context: int) -> DecodeStep:
    """The roofline decode step of a valid plan at `batch` running sequences of `context` tokens on `cluster`."""
    res = check.require_valid()
    elem = dtype_bytes(res.dtype)
    return decode_step(res.placement, res.kv, res.plan.parallel.interleave, cluster, elem, batch, context)
