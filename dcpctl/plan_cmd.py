"""`dcpctl plan validate` and `dcpctl plan show`: rendering of plan checks (no torch)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dcpctl import placement_view
from dcpctl.args import split_plans_and_overrides
from dcpctl.render import render_validation
from engine import dcp
from engine.plan.checks import validate_plan_file
from engine.plan.kv_sizing import format_bytes
from engine.plan.loader import plan_to_dict
from engine.plan.resolved import ResolvedPlan
from engine.plan.validation import PlanCheck

app = typer.Typer(help="Validate and inspect parallelism plans.", no_args_is_help=True)
RANK_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


def check_to_dict(check: PlanCheck) -> dict:
    """A JSON-ready summary of a plan check (what `--json` prints)."""
    problems = check.problems
    data: dict = {
        "plan": check.name,
        "source": check.source,
        "valid": check.valid,
        "errors": [{"field": e.field, "message": e.message, "file": e.file, "line": e.line} for e in problems.errors],
        "warnings": problems.warnings,
        "notes": problems.notes,
    }
    res = check.resolved
    if res is None:
        return data
    data["resolved"] = {
        "device": res.device,
        "dtype": res.dtype,
        "cache_dtype": res.cache_dtype,
        "attention_backend": res.backend,
        "world_size": res.world_size,
        "max_model_len": res.max_model_len,
        "model_path": str(res.model_path) if res.model_path else None,
        "cpu_paths": res.cpu_paths.describe() if res.cpu_paths else None,
    }
    data["config"] = plan_to_dict(res.plan)
    if res.layout is not None:
        data["layout"] = {
            "kind": res.layout.kind,
            "kv_replication": res.layout.replication,
            "replicas": res.layout.replicas,
        }
    if res.kv is not None:
        data["kv_cache"] = {
            "bytes_per_rank": res.kv.bytes_per_rank,
            "blocks_per_rank": res.kv.num_blocks,
            "tokens_per_rank": res.kv.tokens_per_rank,
            "token_capacity": res.kv.token_capacity,
            "bytes_per_token_per_rank": res.kv.bytes_per_token,
        }
    placed = placement_view.resolved_placement(res)
    if placed is not None:
        data["placement"] = placement_view.placement_to_dict(*placed)
    return data


@app.command("validate")
def validate(
    args: Annotated[list[str], typer.Argument(help="Plan files, then KEY=VALUE overrides for every plan.")],
    strict: Annotated[bool, typer.Option(help="Fail when the model folder is absent.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
) -> None:
    """Check plans against the schema, the layout rules and the model; exit 1 if any is invalid."""
    plans, overrides = split_plans_and_overrides(args)
    checks = [validate_plan_file(p, overrides, strict=strict) for p in plans]
    if as_json:
        typer.echo(json.dumps([check_to_dict(c) for c in checks], indent=2))
    else:
        render_validation(Console(), checks)
    raise typer.Exit(0 if all(c.valid for c in checks) else 1)


def ownership_picture(length: int, block_size: int, interleave: int, dcp_size: int) -> Text:
    """Positions 0..length-1 coloured by owning DCP rank; '|' marks a virtual block boundary."""
    span = dcp.tokens_per_virtual_block(block_size, dcp_size)
    per_row = span * max(1, 64 // span) if span <= 64 else 64
    text = Text()
    for row_start in range(0, length, per_row):
        text.append(f"{row_start:>6} ", style="dim")
        for p in range(row_start, min(length, row_start + per_row)):
            if p % span == 0:
                text.append("|" if p else " ", style="bold white")
            elif p == row_start:
                text.append(" ")
            rank = dcp.owner(p, interleave, dcp_size)
            text.append(str(rank % 10), style=f"bold {RANK_COLORS[rank % len(RANK_COLORS)]}")
        text.append("\n")
    return text


def _render_show(console: Console, res: ResolvedPlan, positions: int) -> None:
    plan = res.plan
    p, c = plan.parallel, plan.cache
    console.print(Text.assemble(("plan ", "bold"), plan.name, "  ", (plan.description, "dim")))
    console.print(
        f"model {plan.model.path} -> {res.model_path}  dtype {res.dtype}  "
        f"cache dtype {res.cache_dtype}  device {res.device}  backend {res.backend}"
    )
    if res.cpu_paths is not None:
        console.print(res.cpu_paths.describe())
    layout = res.layout
    if layout is not None:
        dcp_kind = {
            "none": "off",
            "tp": "inside the TP group",
            "replica": f"with {layout.replicas} replicas of the TP group",
        }[layout.kind]
        mla = " (MLA latent)" if layout.is_mla else ""
        console.print(
            f"layout: tp={p.tp} dcp={p.dcp} kv heads={layout.num_kv_heads}{mla}, KV replication "
            f"R={layout.replication}, DCP {dcp_kind}, world size {layout.world_size}"
        )
        placed = placement_view.resolved_placement(res)
        if placed is not None:
            console.print(placement_view.describe(placed[0]))
        ranks = Table(title="Ranks", header_style="bold")
        columns = ["rank", "replica", "tp rank", "dcp group", "dcp rank", "kv heads"]
        if placed is not None:
            columns += ["q heads", "o slice", "weights"]
        for column in (*columns, "device"):
            ranks.add_column(column, justify="right")
        weights = placement_view.weights_per_rank(*placed) if placed is not None else []
        local = res.local_world_size
        for role in layout.roles():
            device = "cpu" if res.device == "cpu" else f"cuda:{role.rank % local}"
            heads = "latent" if layout.is_mla else f"{role.kv_head_start}..{role.kv_head_start + role.kv_heads - 1}"
            cells = [
                str(role.rank),
                str(role.replica),
                str(role.tp_rank),
                str(role.dcp_group),
                Text(str(role.dcp_rank), style=RANK_COLORS[role.dcp_rank % len(RANK_COLORS)]),
                heads,
            ]
            if placed is not None:
                share = placed[0].rank(role.rank)
                cells += [
                    placement_view.q_heads_cell(share),
                    placement_view.o_slice_cell(placed[0], share),
                    format_bytes(weights[role.rank]),
                ]
            ranks.add_row(*cells, device)
        console.print(ranks)
        groups = f"TP groups: {layout.tp_groups()}   DCP groups: {layout.dcp_groups()}"
        if layout.q_span > 1 and placed is not None and placed[0].rank(0).gather_queries:
            groups += f"   query groups: {layout.query_groups()}"
        console.print(groups)
        if placed is not None:
            console.print(placement_view.dense_groups(placed[0]))
            console.print(placement_view.collectives_table(*placed))
            for note in placed[0].notes():
                console.print(Text.assemble(("note ", "dim"), note), soft_wrap=True)
    else:
        console.print("[yellow]rank table needs the model's head counts (model folder absent or plan invalid)[/]")
    if res.kv is not None:
        kv = res.kv
        placed = placement_view.resolved_placement(res) if layout is not None else None
        if placed is not None:
            weights = format_bytes(max(placement_view.weights_per_rank(*placed)))
            console.print(f"memory per rank: weights {weights} + KV {format_bytes(kv.bytes_per_rank)}")
        console.print(
            f"KV cache per rank: {format_bytes(kv.bytes_per_rank)} = {kv.num_blocks} blocks x "
            f"{kv.block_size} tokens x {kv.bytes_per_token} B/token; holds {kv.tokens_per_rank} tokens "
            f"per rank, {kv.token_capacity} tokens of sequences across dcp={kv.dcp}"
        )
    console.print(
        f"ownership of positions 0..{positions - 1} by DCP rank (interleave {p.interleave}, "
        f"block {c.block_size}, virtual block = {dcp.tokens_per_virtual_block(c.block_size, p.dcp)} tokens):"
    )
    console.print(ownership_picture(positions, c.block_size, p.interleave, p.dcp))


@app.command("show")
def show(
    args: Annotated[list[str], typer.Argument(help="A plan file, then KEY=VALUE overrides.")],
    positions: Annotated[int, typer.Option(help="How many positions the ownership picture shows.")] = 128,
) -> None:
    """Draw a plan's ranks, groups, KV memory per rank and token ownership."""
    plans, overrides = split_plans_and_overrides(args)
    if len(plans) != 1:
        raise typer.BadParameter("plan show takes exactly one plan file")
    check = validate_plan_file(plans[0], overrides)
    console = Console()
    blocking = any(e.field in ("parallel.interleave", "cache.block_size") for e in check.problems.errors)
    if check.resolved is None or blocking:
        render_validation(console, [check])
        raise typer.Exit(1)
    _render_show(console, check.resolved, positions)
    if not check.valid:
        render_validation(console, [check])
        raise typer.Exit(1)
