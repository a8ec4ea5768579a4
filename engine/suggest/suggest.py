"""Every layout the plan checks accept for a model on a cluster, ranked under an objective, with the reason each
rejected combination was rejected, and the plan YAML a suggestion writes.

Each candidate is a real plan (`engine.plan.schema.Plan`) run through `engine.plan.checks.check_plan` for the
cluster it names (not this machine's devices): what it accepts is what `plan validate` accepts, and a rejection's
reason is the check's own message. The KV budget per rank is what the device's memory leaves after the rank's
weights (`--kv-memory` fixes it); a suggestion writes it in bytes, so the engine allocates exactly the blocks shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from engine import dcp as dcp_math
from engine.checkpoints.model_info import dtype_bytes
from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.parallel_layout import divisors, kv_replication
from engine.placement.split import COMM_BACKENDS, DENSE_PLACEMENTS, DensePlacement
from engine.placement.weights import weight_bytes
from engine.plan.checks import check_plan
from engine.plan.kv_sizing import format_bytes
from engine.plan.loader import LoadedPlan, plan_to_dict
from engine.plan.schema import CACHE_DTYPES, DTYPES, ParallelSection, Plan
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
    kv_cache_dtype: str = "auto"  # cache.dtype of the plans (fp8: twice bfloat16's tokens per rank)

    def __post_init__(self) -> None:
        if self.context < 1:
            raise UserError(f"--context {self.context} must be >= 1 token")
        if self.concurrency < 1:
            raise UserError(f"--concurrency {self.concurrency} must be >= 1 sequence")
        if self.block_size < 1:
            raise UserError(f"--block-size {self.block_size} must be >= 1 (e.g. 16 or 64)")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in CACHE_DTYPES:
            raise UserError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
        if self.objective not in OBJECTIVES:
            raise UserError(f"--optimize {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.cluster.devices < 1 or self.cluster.nodes < 1:
            raise UserError("--devices and --nodes must be >= 1")
        if self.cluster.total > MAX_DEVICES:
            raise UserError(
                f"--devices x --nodes is {self.cluster.total} devices, over the {MAX_DEVICES} a suggestion enumerates "
                "in reasonable time; plan a slice of the cluster (e.g. one node) and run it as data-parallel copies"
            )


MAX_DEVICES = 1024  # the whole cluster; the grid grows with its divisors (4096 devices took minutes)
DEFAULT_DENSE = ParallelSection.dense  # the placement a plan gets without parallel.dense


class Combo(NamedTuple):
    """One point of the grid: the parallel fields a plan sets."""

    tp: int
    dcp: int
    interleave: int
    dense: str = DEFAULT_DENSE
    comm: str = "ag_rs"  # parallel.dcp_comm_backend


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


def combo_name(stem: str, c: Combo) -> str:
    """The plan name of a combination: the model's stem, then the fields that differ from a plain plan."""
    name = f"{stem}_tp{c.tp}_dcp{c.dcp}" + (f"_i{c.interleave}" if c.dcp > 1 else "")
    return name + ("_replicated" if c.dense != DEFAULT_DENSE else "") + ("_a2a" if c.comm == "a2a" else "")


def combo_of(plan: Plan) -> Combo:
    p = plan.parallel
    return Combo(p.tp, p.dcp, p.interleave, p.dense, p.dcp_comm_backend)


def plan_stem(req: Request) -> str:
    """The model's part of a suggested plan's name."""
    return Path(req.model.plan_path).name.lower().replace(".", "_")


def _plan(req: Request, c: Combo, memory: str, nnodes: int) -> Plan:
    model = req.model
    description = f"dcpctl plan suggest: {req.objective} at {req.context} tokens"
    plan = Plan(name=combo_name(plan_stem(req), c), description=description)
    plan.model.path = model.plan_path
    plan.model.dtype = req.dtype
    plan.model.max_model_len = req.context
    plan.parallel.tp, plan.parallel.dcp, plan.parallel.interleave = c.tp, c.dcp, c.interleave
    plan.parallel.dense, plan.parallel.dcp_comm_backend = c.dense, c.comm
    plan.cache.block_size = req.block_size
    plan.cache.dtype = req.kv_cache_dtype
    plan.cache.memory = memory
    plan.scheduler.max_num_seqs = req.concurrency
    plan.launch.device = req.cluster.spec.kind
    plan.launch.nnodes = nnodes
    if nnodes > 1:
        plan.launch.master_port = MULTI_NODE_PORT
    return plan


def check_candidate(req: Request, plan: Plan, prefill: PlanCheck | None = None) -> PlanCheck:
    """`plan validate`'s check of a plan in memory, for the cluster it names (a P/D plan: with its prefill's)."""
    loaded = LoadedPlan(plan=plan, source=Path(f"{plan.name}.yaml"))
    return check_plan(loaded, model=req.model.info, devices_here=False, prefill=prefill)


def _kv_budget(req: Request, weights: int, local_ranks: int) -> int:
    """KV bytes per rank: --kv-memory, else the device's memory share left after the rank's weights."""
    if req.kv_memory is not None:
        return req.kv_memory
    spec = req.cluster.spec
    if spec.shared:  # one memory for the node's ranks, each holding its own weights
        return int(spec.memory_bytes * MEMORY_FRACTION / local_ranks - weights)
    return int(spec.memory_bytes * MEMORY_FRACTION - weights)


def probe(req: Request, combo: Combo) -> Candidate | None:
    """The combination's layout as the checks see it (a 1GiB KV budget: only the layout and dtype rules matter);
    None for a dense placement other than the default where there are no replica ranks (it would be the same)."""
    plan = _plan(req, combo, "1GiB", 1)
    check = check_candidate(req, plan)
    res = check.resolved
    if res.layout is None:
        return Candidate(plan, check, [e.message for e in check.problems.errors])
    if combo.dense != DEFAULT_DENSE and res.layout.replicas == 1:
        return None  # without replica ranks every placement is the same (tensor-parallel over the TP group)
    return Candidate(plan, check)


def sized(req: Request, probed: Candidate, nnodes: int, local_ranks: int) -> Candidate:
    """A probed layout as a plan whose KV budget is what each rank's memory leaves after its weights, checked.
    `local_ranks`: the ranks sharing one node's memory (a shared-memory device such as a CPU)."""
    combo = combo_of(probed.plan)
    res = probed.check.resolved
    placement = res.placement
    if placement is None:
        return Candidate(probed.plan, probed.check, [e.message for e in probed.check.problems.errors])
    elem = dtype_bytes(res.dtype)
    weights = max(weight_bytes(placement, r, elem) for r in range(res.layout.world_size))
    budget = _kv_budget(req, weights, local_ranks)
    if budget <= 0:
        spec = req.cluster.spec
        return Candidate(
            probed.plan,
            probed.check,
            [
                f"weights of {format_bytes(weights)} per rank leave no KV memory in {format_bytes(spec.memory_bytes)} "
                f"x {MEMORY_FRACTION:g} of a {spec.name} device; use more devices, a larger tp or a 16-bit dtype"
            ],
        )
    plan = _plan(req, combo, f"{budget}B", nnodes)
    check = check_candidate(req, plan)
    if check.problems.errors:
        return Candidate(plan, check, [e.message for e in check.problems.errors])
    kv = check.resolved.kv
    seqs = kv.num_blocks // dcp_math.blocks_needed(req.context, req.block_size, combo.dcp)
    return Candidate(plan, check, [], placement, weights, seqs_at_context=seqs, concurrency=req.concurrency)


def with_step(req: Request, c: Candidate, copies: int) -> Candidate:
    """An accepted candidate run as `copies` engines: each decodes its share of --concurrency, as far as it holds
    them, and its roofline step at that batch."""
    c.copies = copies
    c.batch = max(1, min(-(-req.concurrency // copies), c.seqs_at_context))
    c.plan.scheduler.max_num_seqs = c.batch
    c.step = plan_step(c.check, req.cluster, c.batch, req.context)
    return c


def _evaluate(req: Request, combo: Combo) -> Candidate | None:
    cluster = req.cluster
    first = probe(req, combo)
    if first is None or not first.accepted:
        return first
    world = first.check.resolved.layout.world_size
    if cluster.total % world:
        return Candidate(first.plan, first.check, [f"world size {world} does not divide the {cluster.total} devices"])
    if world > cluster.devices and world % cluster.devices:
        return Candidate(
            first.plan,
            first.check,
            [f"world size {world} spans nodes but is not a multiple of {cluster.devices} per node"],
        )
    nnodes = cluster.nodes_of(world)
    candidate = sized(req, first, nnodes, world // nnodes)
    if not candidate.accepted:
        return candidate
    return with_step(req, candidate, 1 if cluster.spec.shared else cluster.total // world)


def layouts(req: Request, max_world: int) -> list[Combo]:
    """Every tp / dcp / interleave (1 and the block size) / dense placement / DCP combine the grid tries, for worlds
    of up to `max_world` devices."""
    info, block = req.model.info, req.block_size
    combos = []
    for tp in divisors(max_world):
        rep = kv_replication(tp, info.num_kv_heads, info.is_mla)
        for dcp in sorted(set(divisors(rep * max_world // tp)) | set(divisors(max_world))):
            interleaves = (1,) if dcp == 1 else sorted({1, block})
            comms = ("ag_rs",) if dcp == 1 else COMM_BACKENDS
            for interleave in interleaves:
                for dense in DENSE_PLACEMENTS:
                    for comm in comms:
                        combos.append(Combo(tp, dcp, interleave, dense, comm))
    return combos


def suggest(req: Request) -> Suggestion:
    """Check every combination of the grid and rank the accepted ones under the request's objective."""
    accepted, rejected = [], []
    for combo in layouts(req, req.cluster.total):
        candidate = _evaluate(req, combo)
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
    if cluster.spec.shared and res.cpu_comm == "gloo":  # the plan keeps gloo between its local ranks
        cluster = replace(cluster, spec=replace(cluster.spec, link_latency_s=cluster.spec.network_latency_s))
    return decode_step(res.placement, res.kv, res.plan.parallel.interleave, cluster, elem, batch, context)
