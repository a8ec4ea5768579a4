"""Which global rank plays which TP / DCP role, and the process groups that follow (no torch).

Two DCP layouts (DESIGN.md "Parallel layout"), with R = KV replication under TP:
- dcp divides R: DCP groups are runs of dcp consecutive TP ranks (vLLM's rule); world = tp.
- R divides dcp and dcp > R: dcp / R replicas of the TP group; world = tp * dcp / R.

Global rank g = replica * tp + tp_rank. Inside a DCP group, `dcp_rank = replica * q_span + tp_rank % q_span`
where `q_span = min(dcp, R)` is the number of distinct query-head sets in the group.
(The GQA rule (q_heads / K) % dcp == 0 follows from heads % tp == 0 and dcp | R.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


def kv_replication(tp: int, num_kv_heads: int, is_mla: bool) -> int:
    """How many TP ranks hold the same KV heads (R in DESIGN.md)."""
    if is_mla:
        return tp
    return tp // num_kv_heads if tp > num_kv_heads else 1


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, by trial division up to sqrt(n) (capped at 10**6 so that a huge n in a plan
    cannot hang the check; past 10**12 the list, only a hint there, may miss large divisors)."""
    small = [d for d in range(1, min(math.isqrt(n), 10**6) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def valid_dcp_sizes(replication: int, limit: int = 64) -> list[int]:
    """dcp values a TP layout with KV replication R allows: divisors and multiples of R."""
    return sorted(set(divisors(replication)) | set(range(replication, limit + 1, replication)))


def layout_problems(tp: int, dcp: int, num_heads: int, num_kv_heads: int, is_mla: bool) -> list[tuple[str, str]]:
    """Every (field, message) that makes this tp/dcp layout invalid for the model; empty if valid."""
    problems: list[tuple[str, str]] = []
    if tp < 1:
        problems.append(("parallel.tp", f"parallel.tp={tp} must be >= 1"))
    if dcp < 1:
        problems.append(("parallel.dcp", f"parallel.dcp={dcp} must be >= 1"))
    if problems:
        return problems
    valid_tp = [d for d in divisors(num_heads) if is_mla or d % num_kv_heads == 0 or num_kv_heads % d == 0]
    if tp not in valid_tp:
        reason = (
            f"does not divide the model's {num_heads} attention heads"
            if num_heads % tp
            else f"neither divides nor is a multiple of the model's {num_kv_heads} KV heads"
        )
        return [("parallel.tp", f"parallel.tp={tp} {reason}; use tp in {_fmt(valid_tp)}")]
    rep = kv_replication(tp, num_kv_heads, is_mla)
    if rep % dcp and dcp % rep:
        kind = "MLA: R = tp" if is_mla else f"{num_kv_heads} KV heads over tp={tp}"
        problems.append(
            (
                "parallel.dcp",
                f"parallel.dcp={dcp} neither divides nor is a multiple of the KV replication "
                f"R={rep} ({kind}); use dcp in {_fmt(valid_dcp_sizes(rep, max(16, 4 * rep)))}, "
                f"or change parallel.tp",
            )
        )
    return problems


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class RankRole:
    """The roles of one global rank."""

    rank: int
    replica: int
    tp_rank: int
    dcp_rank: int
    dcp_group: int
    kv_head_start: int  # first KV head this rank stores (0 for MLA)
    kv_heads: int  # KV heads this rank stores


@dataclass(frozen=True)
class ParallelLayout:
    """A validated tp/dcp layout for a model; build it with `ParallelLayout.build`."""

    tp: int
    dcp: int
    num_heads: int
    num_kv_heads: int
    is_mla: bool

    @classmethod
    def build(cls, tp: int, dcp: int, num_heads: int, num_kv_heads: int, is_mla: bool) -> ParallelLayout:
        """Check the layout rules and return the layout; ValueError lists every broken rule."""
        problems = layout_problems(tp, dcp, num_heads, num_kv_heads, is_mla)
        if problems:
            raise ValueError("; ".join(msg for _, msg in problems))
        return cls(tp, dcp, num_heads, num_kv_heads, is_mla)

    @property
    def replication(self) -> int:
        """R: TP ranks that hold identical KV heads."""
        return kv_replication(self.tp, self.num_kv_heads, self.is_mla)

    @property
    def replicas(self) -> int:
        """Copies of the TP group (1 unless dcp exceeds R)."""
        return max(1, self.dcp // self.replication)

    @property
    def q_span(self) -> int:
        """Distinct query-head sets inside one DCP group (ranks to gather queries from)."""
        return min(self.dcp, self.replication)

    @property
    def world_size(self) -> int:
        return self.tp * self.replicas

    @property
    def kind(self) -> str:
        """'none', 'tp' (DCP inside the TP group) or 'replica' (extra replica ranks)."""
        if self.dcp == 1:
            return "none"
        return "replica" if self.replicas > 1 else "tp"

    def kv_heads_per_rank(self) -> int:
        return 1 if self.is_mla else max(1, self.num_kv_heads // self.tp)

    def role(self, rank: int) -> RankRole:
        replica, tp_rank = divmod(rank, self.tp)
        span = self.q_span
        heads = self.kv_heads_per_rank()
        if self.is_mla:
            kv_start = 0
        elif self.tp > self.num_kv_heads:
            kv_start = tp_rank // self.replication
        else:
            kv_start = tp_rank * heads
        return RankRole(
            rank=rank,
            replica=replica,
            tp_rank=tp_rank,
            dcp_rank=replica * span + tp_rank % span,
            dcp_group=tp_rank // span,
            kv_head_start=kv_start,
            kv_heads=heads,
        )

    def roles(self) -> list[RankRole]:
        return [self.role(r) for r in range(self.world_size)]

    def tp_groups(self) -> list[list[int]]:
        return [[m * self.tp + t for t in range(self.tp)] for m in range(self.replicas)]

    def dcp_groups(self) -> list[list[int]]:
        """Each DCP group's global ranks, listed in dcp_rank order."""
        span = self.q_span
        return [
            [m * self.tp + key * span + i for m in range(self.replicas) for i in range(span)]
            for key in range(self.tp // span)
        ]

    def query_groups(self) -> list[list[int]]:
        """Ranks of one replica inside a DCP group: the ranks whose query heads are gathered."""
        span = self.q_span
        return [
            [m * self.tp + key * span + i for i in range(span)]
            for m in range(self.replicas)
            for key in range(self.tp // span)
        ]


class HeadSource(NamedTuple):
    """Consecutive KV heads of a decode rank and the prefill DCP group that holds them."""

    src_ranks: tuple[int, ...]  # the prefill DCP group's global ranks, in dcp_rank order
    src_head: int  # first of these heads in the prefill ranks' storage (local head index)
    dst_head: int  # first of these heads in the decode rank's storage (local head index)
    count: int


def kv_head_sources(src: ParallelLayout, dst: ParallelLayout, dst_rank: int) -> list[HeadSource]:
    """Where decode rank `dst_rank` of layout `dst` finds each of its KV heads in layout `src` (same model).

    A head held by several prefill DCP groups (KV replication under TP, or MLA's one latent) is taken from group
    `dst_rank % copies`, which spreads the decode ranks over the copies. ValueError when a head has no source.
    """
    role = dst.role(dst_rank)
    holders: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for group in src.dcp_groups():
        first = src.role(group[0])
        for local in range(first.kv_heads):
            holders.setdefault(first.kv_head_start + local, []).append((tuple(group), local))
    sources: list[HeadSource] = []
    for local in range(role.kv_heads):
        head = role.kv_head_start + local
        copies = holders.get(head)
        if not copies:
            raise ValueError(f"decode rank {dst_rank}'s KV head {head} is held by no prefill rank")
        ranks, src_head = copies[dst_rank % len(copies)]
        last = sources[-1] if sources else None
        if last is not None and last.src_ranks == ranks and last.src_head + last.count == src_head:
            sources[-1] = last._replace(count=last.count + 1)
        else:
            sources.append(HeadSource(ranks, src_head, local, 1))
    return sources
