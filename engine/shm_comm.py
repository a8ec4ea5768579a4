"""Collectives through shared memory for a process group whose ranks all run on this node's CPUs.

gloo moves every collective through TCP on loopback: 0.2-0.7 ms each on a busy 2-core machine, and a decode step
runs dozens. Here the ranks of a group map one segment in /dev/shm and exchange data with sequence flags
(csrc/shm_comm.cpp): a few microseconds per small collective and memory speed for large ones.

Set-up is a collective over the group's gloo process group (which stays for control messages and as the
fallback): the group's first rank creates the segment, every rank maps it, and once all have mapped it the
file is unlinked, so nothing is left in /dev/shm however the processes end. Every rank of the group agrees on
the outcome: the group either uses the segment on all its ranks or on none.

Sums are exact for two ranks (the sum of two numbers does not depend on the order) and, for more, run in
fp32 over the ranks in group order on every rank, so all ranks get the same bits; gloo sums in its own ring
order, so with more than two ranks the two agree to fp32 rounding (bfloat16: one rounding here, one per
step in gloo's). Reductions of other dtypes go through gloo.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from engine.group_comm import GroupComm
from engine.kernels.shm_kernels import build_problem

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20  # per rank and buffer; larger tensors take several rounds (benchmarks/collectives.py)
SUMMABLE = (torch.float32, torch.bfloat16, torch.float16)


class ShmGroup(GroupComm):
    """A process group's collectives through its shared segment (its gloo group for what they do not cover)."""

    def __init__(self, group: dist.ProcessGroup, segment: torch.Tensor):
        super().__init__(group)
        self.segment = segment
        ops = torch.ops.dcpctl_shm
        self._all_reduce = ops.all_reduce.default
        self._all_gather = ops.all_gather.default
        self._reduce_scatter = ops.reduce_scatter.default
        self._all_to_all = ops.all_to_all.default
        self._gather = ops.gather_to_first.default

    def all_reduce(self, x: torch.Tensor) -> None:
        if x.dtype not in SUMMABLE:
            super().all_reduce(x)
        elif x.is_contiguous():
            self._all_reduce(self.segment, self.rank, x)
        else:
            summed = x.contiguous()
            self._all_reduce(self.segment, self.rank, summed)
            x.copy_(summed)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_gather(self.segment, self.rank, x.contiguous())

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in SUMMABLE:
            return super().reduce_scatter_rows(x)
        return self._reduce_scatter(self.segment, self.rank, x.contiguous())

    def all_to_all_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_to_all(self.segment, self.rank, x.contiguous())

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        stacked = self._gather(self.segment, self.rank, x.contiguous())
        return list(stacked.unbind(0)) if self.rank == 0 else None


def attach(group: dist.ProcessGroup, timeout_s: float) -> ShmGroup | str:
    """Map a shared segment for `group` on each of its ranks (collective over the group): the ShmGroup, or why
    the group cannot use one (the same answer on every rank)."""
    rank = dist.get_group_rank(group, dist.get_rank())
    size = dist.get_world_size(group)
    problem = build_problem()
    path: Path | None = None
    if rank == 0 and problem is None:
        path, problem = _create(size, timeout_s)
    box = [None if path is None else str(path), problem]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    path = Path(box[0]) if box[0] else None
    segment, problem = None, box[1]
    try:
        if problem is None:
            segment, problem = _map(path, size, rank)
        problem = _agree(problem, group)  # a barrier: every rank has mapped the file (or failed to)
    finally:
        if rank == 0 and path is not None:
            path.unlink(missing_ok=True)
    if problem is None:
        unseen = torch.ops.dcpctl_shm.unseen_peers(segment, rank)
        problem = _agree(
            f"cannot see its peers' processes {unseen} (another pid namespace?)" if unseen else None, group
        )
    return problem if problem else ShmGroup(group, segment)


def _create(size: int, timeout_s: float) -> tuple[Path | None, str | None]:
    """The group's first rank: the segment file, sized and initialised, or why it cannot be made."""
    if not SHM_DIR.is_dir():
        return None, f"{SHM_DIR} does not exist on this system"
    nbytes = torch.ops.dcpctl_shm.segment_bytes(size, SLOT_BYTES)
    path = SHM_DIR / f"dcpctl-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS
        finally:
            os.close(fd)
        segment = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        torch.ops.dcpctl_shm.init(segment, size, SLOT_BYTES, timeout_s)
    except OSError as exc:
        path.unlink(missing_ok=True)
        return None, f"cannot make a {nbytes >> 20} MiB segment in {SHM_DIR} ({exc.strerror or exc})"
    return path, None


def _map(path: Path, size: int, rank: int) -> tuple[torch.Tensor | None, str | None]:
    """Map the group's segment and record this rank in it."""
    nbytes = torch.ops.dcpctl_shm.segment_bytes(size, SLOT_BYTES)
    try:
        segment = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        torch.ops.dcpctl_shm.attach(segment, rank, dist.get_rank())
    except (OSError, RuntimeError) as exc:
        return None, f"rank {dist.get_rank()} cannot map {path} ({exc}); are all ranks on one node?"
    return segment, None


def _agree(problem: str | None, group: dist.ProcessGroup) -> str | None:
    """None when no rank of the group has a problem; else the problem (this rank's, or a count of its peers')."""
    failed = torch.tensor([0 if problem is None else 1])
    dist.all_reduce(failed, group=group)
    if not failed.item():
        return None
    return problem or f"{int(failed.item())} rank(s) of the group could not use shared memory"
