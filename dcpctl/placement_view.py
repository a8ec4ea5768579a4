"""How `plan show` and `plan validate` present a plan's dense placement: what it means in one line, each rank's
heads, output slice and weights, and the collectives per layer (the facts come from engine.placement; no torch)."""

from __future__ import annotations

from rich.table import Table

from engine.checkpoints.model_info import dtype_bytes
from engine.errors import UserError
from engine.placement.collectives import Collective, collectives, per_step_count
from engine.placement.split import DensePlacement, RankPlacement
from engine.placement.weights import weight_bytes
from engine.plan.kv_sizing import format_bytes
from engine.plan.resolved import ResolvedPlan

TRTLLM_NAME = "TensorRT-LLM cp_config.cp_type: HELIX"


def resolved_placement(res: ResolvedPlan | None) -> tuple[DensePlacement, int] | None:
    """The plan's placement and its model's bytes per element, when both resolved."""
    if res is None or res.placement is None:
        return None
    try:
        return res.placement, dtype_bytes(res.dtype)
    except UserError:  # model.dtype is invalid: the check reports it
        return None


def describe(placement: DensePlacement) -> str:
    """One line: where the dense layers live and which combine DCP runs."""
    layout = placement.layout
    n, t = layout.world_size, layout.tp
    combine = f" DCP combine: {placement.comm_backend}." if layout.dcp > 1 else ""
    if placement.sharded:
        split = [m.module for m in (placement.o_proj, placement.mlp, placement.moe) if m and m.group == "world"]
        names = ", ".join([*split, "embedding and LM head"])
        return (
            f"dense placement: sharded over the world ({n} ranks): {names} split {n} ways; q/k/v computed on every "
            f"rank of a DCP group (Helix; {TRTLLM_NAME}).{combine}"
        )
    if layout.replicas > 1:
        return (
            f"dense placement: replicated: each of the {layout.replicas} replicas of the TP group holds the "
            f"weights of tp={t}; only attention is split over DCP (parallel.dense=sharded splits them over all "
            f"{n} ranks).{combine}"
        )
    return f"dense placement: tensor-parallel over the TP group of {t} rank(s) (no replica ranks).{combine}"


def q_heads_cell(share: RankPlacement) -> str:
    heads = share.attended
    return f"{heads.start}..{heads.stop - 1}"


def o_slice_cell(placement: DensePlacement, share: RankPlacement) -> str:
    """The part of the o_proj input this rank reads: whole heads or feature columns."""
    m = placement.model
    if m.is_mla:
        heads = share.o_proj.span(m.num_heads)
        return f"heads {heads.start}..{heads.stop - 1}"
    cols = share.o_proj.span(m.num_heads * m.head_dim)
    if cols.start % m.head_dim == 0 and len(cols) % m.head_dim == 0:
        return f"heads {cols.start // m.head_dim}..{cols.stop // m.head_dim - 1}"
    return f"cols {cols.start}..{cols.stop - 1}"


def dense_groups(placement: DensePlacement) -> str:
    """The group each dense module is split and summed over."""
    layout = placement.layout
    world = list(range(layout.world_size))
    parts = []
    for m in (placement.o_proj, placement.mlp, placement.moe, placement.vocab):
        if m is not None:
            ranks = world if m.group == "world" else layout.tp_groups()
            parts.append(f"{m.module if m.module != 'vocab' else 'embedding/LM head'} over {m.group} {ranks}")
    return "dense groups: " + "; ".join(parts)


def weights_per_rank(placement: DensePlacement, dtype_bytes: int) -> list[int]:
    return [weight_bytes(placement, r, dtype_bytes) for r in range(placement.layout.world_size)]


def _layers(c: Collective) -> str:
    if c.layers is None:
        return "per step"
    if len(c.layers) == 1:
        return f"layer {c.layers.start}"
    return f"layers {c.layers.start}-{c.layers.stop - 1}"


def collectives_table(placement: DensePlacement, dtype_bytes: int) -> Table:
    """Every collective of a decode step: where, op, group, ranks, bytes each rank sends per decode token."""
    items = collectives(placement, dtype_bytes)
    table = Table(
        title=f"Collectives per decode step: {per_step_count(items)}", header_style="bold", title_justify="left"
    )
    for column in ("layers", "where", "op", "group", "ranks", "bytes / token / rank"):
        table.add_column(column, justify="right" if column in ("ranks", "bytes / token / rank") else "left")
    for c in items:
        table.add_row(_layers(c), c.where, c.op, c.group, str(c.ranks), str(c.bytes_per_token))
    return table


def placement_to_dict(placement: DensePlacement, dtype_bytes: int) -> dict:
    """A JSON-ready summary (what `plan validate --json` prints under "placement")."""
    modules = [m for m in (placement.o_proj, placement.mlp, placement.moe, placement.vocab) if m is not None]
    return {
        "dense": placement.dense,
        "sharded": placement.sharded,
        "dcp_comm_backend": placement.comm_backend,
        "modules": [
            {
                "module": m.module,
                "layers": [m.layers.start, m.layers.stop] if len(m.layers) else None,
                "group": m.group,
                "parts": m.parts,
                "fallback": m.fallback,
            }
            for m in modules
        ],
        "weight_bytes_per_rank": weights_per_rank(placement, dtype_bytes),
        "collectives": [
            {
                "where": c.where,
                "layers": [c.layers.start, c.layers.stop] if c.layers is not None else None,
                "op": c.op,
                "group": c.group,
                "ranks": c.ranks,
                "bytes_per_token": c.bytes_per_token,
            }
            for c in collectives(placement, dtype_bytes)
        ],
        "collectives_per_step": per_step_count(collectives(placement, dtype_bytes)),
    }


def weights_cell(placement: DensePlacement, dtype_bytes: int) -> str:
    """The largest weights of any rank (the validate table's column)."""
    return format_bytes(max(weights_per_rank(placement, dtype_bytes)))
