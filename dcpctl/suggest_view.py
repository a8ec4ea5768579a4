"""`dcpctl plan suggest` rendering: the ranked table, the top layout's collectives, the rejections, and JSON."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from engine.plan.kv_sizing import format_bytes
from engine.suggest.suggest import Candidate, Request, Suggestion


def layout_label(c: Candidate) -> str:
    """A layout in a few words: "tp1 dcp2 i64 rep sharded a2a"."""
    p = c.plan.parallel
    kind = c.check.resolved.layout.kind
    text = f"tp{p.tp} dcp{p.dcp}"
    if p.dcp > 1:
        text += f" i{p.interleave}" + (" rep" if kind == "replica" else "")
    if p.dense == "sharded" and c.placement is not None and c.placement.sharded:
        text += " sharded"
    if p.dcp > 1 and p.dcp_comm_backend == "a2a":
        text += " a2a"
    return text


BOUND_SHORT = {"memory": "mem", "compute": "compute", "communication": "comm"}


def count_text(n: int) -> str:
    for scale, unit in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def rate(bytes_s: float) -> str:
    return f"{bytes_s / 1e12:.3g} TB/s" if bytes_s >= 1e12 else f"{bytes_s / 1e9:.3g} GB/s"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def render_header(console: Console, req: Request) -> None:
    """The model, the cluster, the request and the device's figures."""
    spec, cluster = req.cluster.spec, req.cluster
    console.print(
        f"[bold]{req.model.info.architecture}[/] from {req.model.origin}; {cluster.total} x {spec.name}"
        + (f" ({cluster.nodes} nodes)" if cluster.nodes > 1 else "")
        + f"; context {req.context} tokens, concurrency {req.concurrency}; best first for [bold]{req.objective}[/]",
        highlight=False,
    )
    console.print(
        f"device: {format_bytes(spec.memory_bytes)}, memory {rate(spec.bandwidth)}, "
        f"{spec.flops(2) / 1e12:.3g} TFLOP/s 16-bit, link {rate(spec.link_bandwidth)}; {spec.source}",
        style="dim",
        highlight=False,
    )
    if not req.model.runnable:
        console.print(
            f"[yellow]note[/] the engine does not run {req.model.info.architecture} yet; it is planned by its shape"
        )


def render_suggestion(console: Console, s: Suggestion, top: int, show_rejected: bool) -> None:
    """The accepted layouts best first (at most `top`), the first one's collectives, and with `show_rejected` why
    every other combination was rejected."""
    req = s.request
    render_header(console, req)
    table = Table(header_style="bold")
    for column in ("#", "layout", "world", "weights/rank", "KV B/tok/rank", "tokens", f"seqs@{req.context}"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for column in ("step ms", "bound", "tok/s"):
        table.add_column(column, justify="left" if column == "bound" else "right")
    for i, c in enumerate(s.accepted[:top], 1):
        kv = c.check.resolved.kv
        world = str(c.check.resolved.world_size) + (f"x{c.copies}" if c.copies > 1 else "")
        seqs = str(c.seqs_at_context) + ("" if c.serves_concurrency else " [red]<C[/]")
        table.add_row(
            str(i),
            layout_label(c),
            world,
            format_bytes(c.weight_bytes_per_rank),
            f"{c.kv_bytes_per_token_per_rank:,.0f}",
            count_text(kv.token_capacity),
            seqs,
            *step_cells(c),
        )
    if s.accepted:
        console.print(table)
        render_more(console, len(s.accepted), top, "layout(s)")
        render_collectives(console, s.accepted[0], "#1")
    if not s.accepted:
        console.print("[red]no layout the plan checks accept[/] for this model, cluster and context:")
    if show_rejected or not s.accepted:
        _render_rejected(console, s)
    elif s.rejected:
        console.print(f"{len(s.rejected)} combination(s) rejected by the plan checks: --all says why", style="dim")


def step_cells(c: Candidate) -> tuple[str, str, str]:
    """The step ms, bound and tok/s cells of an accepted candidate."""
    return ms(c.step.seconds), BOUND_SHORT[c.step.bound], f"{c.tokens_per_s:,.0f}"


def render_more(console: Console, accepted: int, top: int, what: str) -> None:
    """How many accepted rows the table left out."""
    hidden = accepted - min(top, accepted)
    if hidden:
        console.print(f"{hidden} more accepted {what}: --top {accepted} shows them", style="dim")


def render_collectives(console: Console, c: Candidate, label: str) -> None:
    """How `c`'s roofline step adds up, and each collective of it."""
    step = c.step
    console.print(
        f"{label} {c.name}: step {ms(step.seconds)} ms = max(weights {ms(step.memory_s)}, matmuls "
        f"{ms(step.compute_s)}) + attention {ms(step.attention_s)} + collectives {ms(step.comm_s)} + host "
        f"{ms(step.overhead_s)} + serving {ms(step.serve_s)} at {c.batch} sequence(s) per engine",
        highlight=False,
    )
    if not step.collectives:
        console.print("  no collectives (one rank)", style="dim")
    for x in step.collectives:
        where = " across nodes" if x.crosses_nodes else ""
        console.print(
            f"  {x.where}: {x.op} over {x.group} ({x.ranks} ranks{where}), {x.count} per step, "
            f"{format_bytes(x.bytes_per_step)} sent per rank, {ms(x.seconds)} ms",
            highlight=False,
        )


def _render_rejected(console: Console, s: Suggestion) -> None:
    if not s.rejected:
        console.print("no combination was rejected", style="dim")
        return
    console.print(rejected_table("Rejected", [(c.name, c.rejected) for c in s.rejected]))


def rejected_table(title: str, rows: list[tuple[str, list[str]]]) -> Table:
    """One row per rejected plan: its name and every reason."""
    table = Table(title=title, header_style="bold")
    table.add_column("plan")
    table.add_column("why")
    for name, reasons in rows:
        table.add_row(name, "\n".join(reasons))
    return table


def suggestion_to_dict(s: Suggestion) -> dict[str, Any]:
    """Everything the table shows, and the rejections, as JSON-ready data."""
    return {
        **request_dict(s.request),
        "accepted": [candidate_dict(c) for c in s.accepted],
        "rejected": [{"plan": c.name, **parallel_dict(c), "reasons": c.rejected} for c in s.rejected],
    }


def request_dict(req: Request) -> dict[str, Any]:
    """The model, the device figures and the request, as JSON-ready data."""
    spec = req.cluster.spec
    return {
        "model": {"path": req.model.plan_path, "architecture": req.model.info.architecture, "origin": req.model.origin},
        "device": {
            "name": spec.name,
            "devices": req.cluster.devices,
            "nodes": req.cluster.nodes,
            "memory_bytes": spec.memory_bytes,
            "bandwidth_bytes_s": spec.bandwidth,
            "flops_16bit": spec.flops16,
            "flops_fp32": spec.flops32,
            "link_bandwidth_bytes_s": spec.link_bandwidth,
            "source": spec.source,
        },
        "context": req.context,
        "concurrency": req.concurrency,
        "objective": req.objective,
    }


def parallel_dict(c: Candidate) -> dict[str, Any]:
    p = c.plan.parallel
    return {
        "tp": p.tp,
        "dcp": p.dcp,
        "interleave": p.interleave,
        "dense": p.dense,
        "dcp_comm_backend": p.dcp_comm_backend,
    }


def candidate_dict(c: Candidate) -> dict[str, Any]:
    res, step = c.check.resolved, c.step
    return {
        "plan": c.name,
        **parallel_dict(c),
        "block_size": c.plan.cache.block_size,
        "layout": res.layout.kind,
        "world_size": res.world_size,
        "copies": c.copies,
        "nnodes": c.plan.launch.nnodes,
        "dtype": res.dtype,
        "weight_bytes_per_rank": c.weight_bytes_per_rank,
        "kv_bytes_per_rank": res.kv.bytes_per_rank,
        "kv_bytes_per_token_per_rank": c.kv_bytes_per_token_per_rank,
        "blocks_per_rank": res.kv.num_blocks,
        "token_capacity": res.kv.token_capacity,
        "seqs_at_context": c.seqs_at_context,
        "batch": c.batch,
        "serves_concurrency": c.serves_concurrency,
        "step_s": step.seconds,
        "step": {
            "memory_s": step.memory_s,
            "compute_s": step.compute_s,
            "attention_s": step.attention_s,
            "comm_s": step.comm_s,
            "overhead_s": step.overhead_s,
            "serve_s": step.serve_s,
            "bytes_read": step.bytes_read,
            "flops": step.flops,
            "bound": step.bound,
        },
        "collectives": [
            {
                "where": x.where,
                "op": x.op,
                "group": x.group,
                "ranks": x.ranks,
                "per_step": x.count,
                "bytes_per_step": x.bytes_per_step,
                "crosses_nodes": x.crosses_nodes,
                "seconds": x.seconds,
            }
            for x in step.collectives
        ],
        "tokens_per_s": c.tokens_per_s,
    }
