"""`dcpctl plan suggest --pd` rendering: the ranked P/D pairs, interleave 1 against the block size for the hand-off,
the best pair's decode step, the rejections, and JSON."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from dcpctl.suggest_view import (
    candidate_dict,
    count_text,
    layout_label,
    ms,
    parallel_dict,
    rate,
    rejected_table,
    render_collectives,
    render_header,
    render_more,
    request_dict,
    step_cells,
)
from engine.plan.kv_sizing import format_bytes
from engine.suggest.pd import Handoff, Pair, PDSuggestion, interleave_companion


def _descriptors(h: Handoff) -> str:
    counts = [p.descriptors for p in h.per_rank]
    low, high = min(counts), max(counts)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def render_pd(console: Console, s: PDSuggestion, top: int, show_rejected: bool) -> None:
    """The accepted pairs best first (at most `top`), what interleave buys the hand-off, the first pair's decode
    step, and with `show_rejected` why pairs and layouts were rejected."""
    req = s.request
    render_header(console, req)
    table = Table(header_style="bold", title=f"P/D pairs: hand-off of one {req.context}-token request")
    for column in ("#", "prefill", "decode", "ranks", "decode tokens", f"seqs@{req.context}"):
        table.add_column(column, justify="left" if column in ("prefill", "decode") else "right")
    for column in ("pull/rank", "descriptors/rank", "hand-off ms", "step ms", "bound", "tok/s"):
        table.add_column(column, justify="left" if column == "bound" else "right")
    for i, p in enumerate(s.accepted[:top], 1):
        d, h = p.decode, p.handoff
        seqs = str(d.seqs_at_context) + ("" if d.serves_concurrency else " [red]<C[/]")
        table.add_row(
            str(i),
            f"{layout_label(p.prefill)} ({p.prefill.check.resolved.world_size})",
            f"{layout_label(d)} ({d.check.resolved.world_size})",
            str(p.ranks),
            count_text(d.check.resolved.kv.token_capacity),
            seqs,
            format_bytes(h.max_bytes),
            _descriptors(h),
            ms(h.seconds) + (" net" if h.crosses_nodes else ""),
            *step_cells(d),
        )
    if s.accepted:
        console.print(table)
        render_more(console, len(s.accepted), top, "pair(s)")
        _render_interleave(console, s)
        best = s.accepted[0]
        h = best.handoff
        link = "the network" if h.crosses_nodes else "the link"
        console.print(
            f"#1 hand-off: {format_bytes(h.total_bytes)} over {len(h.per_rank)} decode rank(s), "
            f"{_descriptors(h)} descriptors each, {ms(h.seconds)} ms at {rate(h.bandwidth)} ({link}; the busiest "
            "endpoint decides)",
            highlight=False,
        )
        render_collectives(console, best.decode, "#1 decode")
    else:
        console.print("[red]no P/D pair the plan checks accept[/] for this model, cluster and context:")
    if s.too_large:
        console.print(f"{s.too_large} pair(s) need more devices than the cluster has (left out)", style="dim")
    rejected = len(s.rejected) + len(s.rejected_layouts)
    if show_rejected or not s.accepted:
        if s.rejected:
            console.print(rejected_table("Rejected pairs", [(p.name, p.rejected) for p in s.rejected]))
        if s.rejected_layouts:
            rows = [(c.name, c.rejected) for c in s.rejected_layouts]
            console.print(rejected_table("Layouts rejected on their own", rows))
        if not rejected:
            console.print("no pair or layout was rejected", style="dim")
    elif rejected:
        console.print(f"{rejected} pair(s) or layout(s) rejected by the plan checks: --all says why", style="dim")


def _render_interleave(console: Console, s: PDSuggestion) -> None:
    """Interleave 1 against the block size for the best pair with a DCP decode side: the same bytes, in runs of one
    token against whole blocks."""
    for pair in s.accepted:
        other = interleave_companion(s, pair)
        if other is None:
            continue
        one, whole = (pair, other) if pair.decode.plan.parallel.interleave == 1 else (other, pair)
        a, b = one.handoff.max_descriptors, whole.handoff.max_descriptors
        block = whole.decode.plan.parallel.interleave
        d = pair.decode.plan.parallel
        console.print(
            f"interleave, decode tp{d.tp} dcp{d.dcp} from prefill {layout_label(pair.prefill)}: i1 needs {a:,} "
            f"descriptors per decode rank, i{block} (= block size) {b:,}: {a / max(1, b):.3g}x fewer for the same "
            f"bytes ({format_bytes(one.handoff.max_bytes)} and {format_bytes(whole.handoff.max_bytes)} per rank: "
            "a whole last block)",
            highlight=False,
        )
        return


def pd_to_dict(s: PDSuggestion) -> dict[str, Any]:
    """Every pair the table shows, and the rejections, as JSON-ready data."""
    return {
        **request_dict(s.request),
        "pairs": [_pair_dict(p) for p in s.accepted],
        "rejected_pairs": [
            {
                "plan": p.name,
                "prefill": parallel_dict(p.prefill),
                "decode": parallel_dict(p.decode),
                "reasons": p.rejected,
            }
            for p in s.rejected
        ],
        "rejected_layouts": [{"plan": c.name, **parallel_dict(c), "reasons": c.rejected} for c in s.rejected_layouts],
        "pairs_beyond_devices": s.too_large,
    }


def _pair_dict(p: Pair) -> dict[str, Any]:
    h = p.handoff
    return {
        "plan": p.name,
        "ranks": p.ranks,
        "prefill": {
            **parallel_dict(p.prefill),
            "plan": p.prefill.name,
            "world_size": p.prefill.check.resolved.world_size,
            "token_capacity": p.prefill.check.resolved.kv.token_capacity,
        },
        "decode": candidate_dict(p.decode),
        "handoff": {
            "descriptors_per_rank": [x.descriptors for x in h.per_rank],
            "bytes_per_rank": [x.nbytes for x in h.per_rank],
            "bytes": h.total_bytes,
            "bandwidth_bytes_s": h.bandwidth,
            "crosses_nodes": h.crosses_nodes,
            "seconds": h.seconds,
        },
    }
