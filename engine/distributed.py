"""Process groups of a plan's layout and the collectives the layers use.

One module-level `ParallelContext` (set once per process by `init_parallel`) tells the layers
their groups and, from the plan's dense placement (engine.placement), the slice of each module
they hold (`Shard`); model code stays free of rank arithmetic. With a world of one every
collective is skipped. Each group's tensor collectives go through a `GroupComm` (engine.group_comm):
torch.distributed, gloo on CPU and NCCL plus a gloo group for host metadata (the per-step plans rank 0
broadcasts) on CUDA; with `launch.cpu_comm` resolved to shm, a shared-memory segment per group instead
(`engine.shm_comm.ShmGroup`), and gloo carries the control messages.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import shm_comm
from engine.errors import UserError
from engine.group_comm import GroupComm
from engine.parallel_layout import ParallelLayout, RankRole
from engine.placement.split import DensePlacement, RankPlacement, Split

TIMEOUT_ENV = "DCPCTL_COLLECTIVE_TIMEOUT"


def collective_timeout_s() -> float:
    """Seconds a collective between computing ranks may wait ($DCPCTL_COLLECTIVE_TIMEOUT, default 300): a dead or
    stuck rank surfaces as an error, not a hang. A UserError naming the variable for anything but a positive number."""
    text = os.environ.get(TIMEOUT_ENV, "300")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds (default 300)")
    return value


# Followers wait on the control group while a server is idle; torchrun ends them if rank 0 dies.
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Shard:
    """This rank's slice of one layer dimension (`split`, from the placement) and the group that sums the partial
    outputs (None when it has one rank)."""

    split: Split
    group: dist.ProcessGroup | None

    @property
    def parts(self) -> int:
        return self.split.parts

    @property
    def index(self) -> int:
        return self.split.index


@dataclass
class ParallelContext:
    """This rank's place in the layout, its share of the dense placement and its process groups (None when the
    group has one rank)."""

    layout: ParallelLayout
    rank: int
    local_rank: int
    device: torch.device
    role: RankRole
    placement: RankPlacement
    comm_backend: str  # the DCP combine: ag_rs | a2a
    tp_group: dist.ProcessGroup | None = None
    dcp_group: dist.ProcessGroup | None = None
    query_group: dist.ProcessGroup | None = None
    world_group: dist.ProcessGroup | None = None  # the device backend over all ranks: dense layers split over them
    control_group: dist.ProcessGroup | None = None  # gloo, all ranks: step plans
    collectives: str = ""  # what carries the tensor collectives, for the start-up line

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.role.tp_rank

    @property
    def dcp_size(self) -> int:
        return self.layout.dcp

    @property
    def dcp_rank(self) -> int:
        return self.role.dcp_rank

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def computes_logits(self) -> bool:
        """Whether this rank runs the LM head: the ranks its vocabulary is split over (rank 0 samples)."""
        return self.placement.computes_logits

    @property
    def tp_shard(self) -> Shard:
        """This rank's TP slice (the layers' default)."""
        return Shard(Split("tp", self.tp_size, self.tp_rank), self.tp_group)

    def shard(self, split: Split) -> Shard:
        """The slice `split` of a layer on this rank, with the process group of its split."""
        return Shard(split, self.world_group if split.group == "world" else self.tp_group)


_CONTEXT: ParallelContext | None = None
_COMMS: dict[dist.ProcessGroup, GroupComm] = {}  # each group's collectives (shm_comm.ShmGroup: shared memory)


def get_parallel() -> ParallelContext:
    if _CONTEXT is None:
        raise RuntimeError("the parallel context is not initialised (engine.distributed.init_parallel)")
    return _CONTEXT


def set_parallel(context: ParallelContext) -> None:
    global _CONTEXT
    _CONTEXT = context


def single_context(placement: DensePlacement, device: torch.device) -> ParallelContext:
    """Context for a one-rank world (no process group at all), not made current."""
    layout = placement.layout
    return ParallelContext(
        layout=layout,
        rank=0,
        local_rank=0,
        device=device,
        role=layout.role(0),
        placement=placement.rank(0),
        comm_backend=placement.comm_backend,
    )


def init_single(placement: DensePlacement, device: torch.device) -> ParallelContext:
    """Context for a one-rank world, made current."""
    context = single_context(placement, device)
    set_parallel(context)
    return context


@contextlib.contextmanager
def using_parallel(context: ParallelContext) -> Iterator[None]:
    """Make `context` current while a model is built under it (a draft model of one rank inside a rank of a larger
    world): layers take their shards and groups when built, so the previous context is back afterwards."""
    previous = _CONTEXT
    set_parallel(context)
    try:
        yield
    finally:
        set_parallel(previous)


def _groups(layout_groups: list[list[int]], rank: int, backend: str, timeout: datetime.timedelta):
    """Create every group (all ranks must call new_group for each); return this rank's, None if it has one rank."""
    mine, size = None, 1
    for ranks in layout_groups:
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine, size = group, len(ranks)
    return mine if size > 1 else None


def init_parallel(
    placement: DensePlacement,
    device_type: str,
    dist_backend: str,
    cpu_comm: str = "gloo",
    cpu_comm_strict: bool = False,
) -> ParallelContext:
    """Join the torchrun world (env:// rendezvous) and build the layout's groups for this rank.

    `cpu_comm`: "shm" gives the groups shared-memory collectives (a CPU world on one node); where a group cannot
    have them it keeps gloo with a reason in `collectives`, or, `cpu_comm_strict`, a UserError.
    """
    layout = placement.layout
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world != layout.world_size:
        raise RuntimeError(f"torchrun started {world} ranks but the plan's layout needs {layout.world_size}")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = dist_backend if dist_backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    dist.init_process_group(backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    context = ParallelContext(
        layout=layout,
        rank=rank,
        local_rank=local_rank,
        device=device,
        role=layout.role(rank),
        placement=placement.rank(rank),
        comm_backend=placement.comm_backend,
    )
    context.tp_group = _groups(layout.tp_groups(), rank, backend, timeout)
    context.dcp_group = _groups(layout.dcp_groups(), rank, backend, timeout)
    context.query_group = _groups(layout.query_groups(), rank, backend, timeout)
    context.world_group = dist.group.WORLD if world > 1 else None
    if context.dcp_group is not None and dist.get_group_rank(context.dcp_group, rank) != context.dcp_rank:
        raise RuntimeError(f"rank {rank}: its DCP group orders it {dist.get_group_rank(context.dcp_group, rank)}")
    context.control_group = dist.new_group(
        list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S)
    )
    groups = [context.tp_group, context.dcp_group, context.query_group, context.world_group]
    context.collectives = backend
    if backend == "gloo" and cpu_comm == "shm":
        context.collectives = use_shared_memory(groups, cpu_comm_strict)
    set_parallel(context)
    return context


def use_shared_memory(groups: list[dist.ProcessGroup | None], strict: bool) -> str:
    """Give each group (collectively, in the same order on every rank) shared-memory collectives; say what carries
    the collectives now. A group that cannot have them keeps gloo, or, `strict`, raises a UserError naming why."""
    problems = []
    by_ranks: dict[tuple[int, ...], shm_comm.ShmGroup | str] = {}
    for group in groups:
        if group is None or isinstance(_COMMS.get(group), shm_comm.ShmGroup):
            continue
        # groups of the same ranks share a segment: every rank issues their collectives in the same order
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in by_ranks:
            by_ranks[ranks] = shm_comm.attach(group, collective_timeout_s())
        attached = by_ranks[ranks]
        if isinstance(attached, str):
            if strict:
                raise UserError(f"launch.cpu_comm=shm: {attached}; set launch.cpu_comm=gloo (or auto)")
            problems.append(attached)
        else:
            _COMMS[group] = attached
    if problems:
        return f"gloo (shared memory unavailable: {problems[0]})"
    return "shared memory (gloo for control messages)"


def _comm(group: dist.ProcessGroup) -> GroupComm:
    """The group's collectives: through shared memory where `use_shared_memory` gave it a segment, else
    torch.distributed."""
    comm = _COMMS.get(group)
    if comm is None:
        comm = _COMMS[group] = GroupComm(group)
    return comm


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group in place (no-op for a one-rank group)."""
    if group is not None:
        _comm(group).all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Elementwise maximum over the group in place (no-op for a one-rank group); torch.distributed's own collective,
    for the rare call (calibration) that needs it."""
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0, in group-rank order."""
    return x if group is None else _comm(group).all_gather_rows(x)


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group and keep this rank's dim-0 chunk."""
    return x if group is None else _comm(group).reduce_scatter_rows(x)


def all_to_all_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send dim-0 chunk i of `x` to group rank i; returns the chunks received, stacked in source-rank order."""
    return x if group is None else _comm(group).all_to_all_rows(x)


def gather_to_first(x: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor] | None:
    """Every rank's `x` on the group's first rank (None elsewhere)."""
    return [x] if group is None else _comm(group).gather_to_first(x)


def broadcast_object(obj: object, group: dist.ProcessGroup | None) -> object:
    """Send rank 0's `obj` (picklable) to every rank of the control group."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_objects(obj: object, group: dist.ProcessGroup | None) -> list[object] | None:
    """Every rank's picklable `obj` on rank 0 of the control group, in rank order (None on the other ranks)."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out
