"""P/D pairs for `plan suggest --pd`: a prefill layout and a decode layout that split the cluster's devices between
two instances, checked together by the P/D plan checks, with what the decode side holds, the hand-off of one request
and the decode step.

The decode plan is a real P/D plan (its `disagg.prefill` names the prefill plan) checked by `check_plan` with the
prefill plan's own check, so a pair is accepted exactly when `plan validate` accepts the two files. The hand-off is
counted by the planner the engine pulls with (`engine.kv_transfer.summary.rank_pulls`), and timed at the link's
bandwidth (the network's when the instances cannot share a node), limited by the busiest endpoint: the decode rank
that reads the most, or the prefill rank that serves the most. The prefill side is enumerated with the default dense
placement and DCP combine: both only change the decode step, which the prefill instance does not run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.kv_transfer.summary import RankPull, rank_pulls
from engine.plan.disagg import handoff_side
from engine.plan.validation import PlanCheck
from engine.suggest.suggest import (
    DEFAULT_DENSE,
    Candidate,
    Combo,
    Request,
    check_candidate,
    combo_name,
    combo_of,
    layouts,
    plan_stem,
    plan_yaml,
    probe,
    sized,
    with_step,
)


@dataclass(frozen=True)
class Handoff:
    """One request's hand-off at the requested context: what each decode rank pulls, and its time on the link."""

    per_rank: tuple[RankPull, ...]  # per decode rank
    bandwidth: float  # bytes/s of the link the pull crosses
    crosses_nodes: bool
    seconds: float

    @property
    def max_descriptors(self) -> int:
        return max(p.descriptors for p in self.per_rank)

    @property
    def max_bytes(self) -> int:
        return max(p.nbytes for p in self.per_rank)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.per_rank)


@dataclass
class Pair:
    """A prefill instance and a decode instance: each side's sized plan, the decode plan's check with the pair rules,
    and (accepted) the hand-off."""

    prefill: Candidate
    decode: Candidate  # its plan names the prefill plan (disagg.prefill); its check includes the pair's rules
    rejected: list[str]
    handoff: Handoff | None = None

    @property
    def name(self) -> str:
        return self.decode.name

    @property
    def ranks(self) -> int:
        return self.prefill.check.resolved.world_size + self.decode.check.resolved.world_size

    @property
    def serves_concurrency(self) -> bool:
        return self.decode.serves_concurrency


@dataclass
class PDSuggestion:
    request: Request
    accepted: list[Pair]
    rejected: list[Pair]  # both sides valid on their own, the pair not
    rejected_layouts: list[Candidate]  # layouts no pair can use: the plan checks reject them on their own
    too_large: int  # pairs left out because the two worlds need more devices than the cluster has


def _shown(seconds: float) -> float:
    """Times as the table shows them (3 digits): rows that read the same tie, and the hand-off decides."""
    return float(f"{seconds:.3g}")


def _ranking(objective: str, p: Pair) -> tuple:
    d, h = p.decode, p.handoff
    capacity = d.check.resolved.kv.token_capacity
    step, handoff = _shown(d.step.seconds), _shown(h.seconds)
    simpler = (h.max_descriptors, p.ranks, p.prefill.plan.parallel.dcp, d.plan.parallel.dcp)
    if objective == "capacity":
        return (-capacity, step, handoff, *simpler)
    if objective == "latency":
        return (not p.serves_concurrency, step, handoff, -capacity, *simpler)
    return (not p.serves_concurrency, -_shown(d.tokens_per_s), step, handoff, *simpler)


def _worlds_fit(req: Request, prefill: int, decode: int) -> bool:
    """Both instances fit the cluster: on one node together, or each on whole nodes of its own once it spans nodes."""
    per_node, nodes = req.cluster.devices, req.cluster.nodes
    if prefill + decode <= per_node:
        return True
    if any(w > per_node and w % per_node for w in (prefill, decode)):
        return False
    return -(-prefill // per_node) + -(-decode // per_node) <= nodes


def _same_node(req: Request, prefill: int, decode: int) -> bool:
    return prefill + decode <= req.cluster.devices


def _handoff(req: Request, prefill: PlanCheck, decode: PlanCheck) -> Handoff:
    pulls = tuple(rank_pulls(handoff_side(prefill.resolved), handoff_side(decode.resolved), req.context))
    spec = req.cluster.spec
    crosses = not _same_node(req, prefill.resolved.world_size, decode.resolved.world_size)
    bandwidth, latency = (
        (spec.network_bandwidth, spec.network_latency_s) if crosses else (spec.link_bandwidth, spec.link_latency_s)
    )
    sent: dict[int, int] = {}
    for pull in pulls:
        for rank, nbytes in pull.sent.items():
            sent[rank] = sent.get(rank, 0) + nbytes
    busiest = max([p.nbytes for p in pulls] + list(sent.values()))
    return Handoff(pulls, bandwidth, crosses, latency + busiest / bandwidth)


def _probes(req: Request, max_world: int, prefill_side: bool) -> tuple[list[Candidate], list[Candidate]]:
    """(accepted, rejected) layouts of up to `max_world` ranks as the checks see them, one per combination."""
    combos: dict[Combo, None] = {}
    for world in range(1, max_world + 1):
        for combo in layouts(req, world):
            if not prefill_side or (combo.dense, combo.comm) == (DEFAULT_DENSE, "ag_rs"):
                combos[combo] = None
    accepted, rejected = [], []
    for combo in combos:
        c = probe(req, combo)
        if c is None:
            continue
        if not c.accepted:
            rejected.append(c)
        elif c.check.resolved.world_size <= max_world:
            accepted.append(c)
    return accepted, rejected


def _side(req: Request, probed: Candidate, role: str, local: int, cache: dict) -> Candidate:
    """One instance's plan sized for its memory (`local` ranks of both instances share a shared-memory node)."""
    world = probed.check.resolved.world_size
    nnodes = req.cluster.nodes_of(world)
    key = (role, probed.name, nnodes, local if req.cluster.spec.shared else 0)
    if key not in cache:
        c = sized(req, probed, nnodes, local if req.cluster.spec.shared else world // nnodes)
        c.plan.name = combo_name(f"{plan_stem(req)}_{role}", combo_of(c.plan))
        cache[key] = c
    return cache[key]


def suggest_pd(req: Request) -> PDSuggestion:
    """Every prefill x decode layout pair that fits the cluster, checked as a P/D plan, ranked under the objective."""
    max_world = req.cluster.total - 1
    prefills, bad_p = _probes(req, max_world, prefill_side=True)
    decodes, bad_d = _probes(req, max_world, prefill_side=False)
    rejected_layouts = {c.name: c for c in bad_p + bad_d}
    sides: dict = {}
    handoffs: dict = {}
    accepted, rejected, too_large = [], [], 0
    for p_probe in prefills:
        for d_probe in decodes:
            wp, wd = p_probe.check.resolved.world_size, d_probe.check.resolved.world_size
            if not _worlds_fit(req, wp, wd):
                too_large += 1
                continue
            local = wp + wd
            prefill = _side(req, p_probe, "prefill", local, sides)
            decode = _side(req, d_probe, "decode", local, sides)
            bad = [c for c in (prefill, decode) if not c.accepted]
            if bad:
                rejected_layouts.update((c.name, c) for c in bad)
                continue
            pair = _pair(req, prefill, decode, handoffs)
            (accepted if not pair.rejected else rejected).append(pair)
    accepted.sort(key=lambda p: _ranking(req.objective, p))
    return PDSuggestion(req, accepted, rejected, list(rejected_layouts.values()), too_large)


def _pair(req: Request, prefill: Candidate, decode: Candidate, handoffs: dict) -> Pair:
    plan = replace(decode.plan, disagg=replace(decode.plan.disagg, prefill=f"{prefill.name}.yaml"))
    plan.name = f"{decode.name}_from_{prefill.name.split('_prefill_', 1)[-1]}"
    check = check_candidate(req, plan, prefill=prefill.check)
    paired = Candidate(
        plan,
        check,
        [e.message for e in check.problems.errors],
        decode.placement,
        decode.weight_bytes_per_rank,
        seqs_at_context=decode.seqs_at_context,
        concurrency=req.concurrency,
    )
    if paired.rejected:
        return Pair(prefill, paired, paired.rejected)
    with_step(req, paired, 1)
    p, d = prefill.plan.parallel, decode.plan.parallel
    key = (p.tp, p.dcp, p.interleave, d.tp, d.dcp, d.interleave)
    if key not in handoffs:
        handoffs[key] = _handoff(req, prefill.check, check)
    return Pair(prefill, paired, [], handoffs[key])


def interleave_companion(s: PDSuggestion, pair: Pair) -> Pair | None:
    """The accepted pair that differs from `pair` only in the decode side's interleave (1 <-> block size)."""
    d = pair.decode.plan.parallel
    if d.dcp == 1:
        return None
    other = 1 if d.interleave != 1 else pair.decode.plan.cache.block_size
    want = (pair.prefill.name, d.tp, d.dcp, other, d.dense, d.dcp_comm_backend)
    for q in s.accepted:
        e = q.decode.plan.parallel
        if (q.prefill.name, e.tp, e.dcp, e.interleave, e.dense, e.dcp_comm_backend) == want:
            return q
    return None


def prefill_path(decode_path: Path) -> Path:
    """Where `--write` puts the prefill plan of a pair written to `decode_path`: beside it, `<stem>_prefill.yaml`."""
    return decode_path.with_name(f"{decode_path.stem}_prefill{decode_path.suffix or '.yaml'}")


def write_pair(pair: Pair, path: str | Path) -> tuple[Path, Path]:
    """Write the decode plan to `path` and its prefill plan beside it (the decode plan names it); atomic each."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"--write {target} is a folder; give a file such as {target / (pair.name + '.yaml')}")
    pre = prefill_path(target)
    decode = replace(pair.decode, plan=replace(pair.decode.plan))
    decode.plan.disagg = replace(decode.plan.disagg, prefill=pre.name)
    atomic_write_text(pre, plan_yaml(pair.prefill))
    return atomic_write_text(target, plan_yaml(decode)), pre
