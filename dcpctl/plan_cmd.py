"""`dcpctl plan validate`, `plan show` and `plan suggest`: rendering of plan checks and suggestions (no torch)."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dcpctl import placement_view
from dcpctl.args import split_plans_and_overrides
from dcpctl.pd_suggest_view import pd_to_dict, render_pd
from dcpctl.render import render_validation
from dcpctl.suggest_view import render_suggestion, suggestion_to_dict
from engine import dcp
from engine.checkpoints.model_info import dtype_bytes
from engine.dcp import DcpSpec
from engine.errors import UserError
from engine.io_utils import writable_file
from engine.kv_transfer.summary import HandoffSide
from engine.plan.checks import validate_plan_file
from engine.plan.disagg import handoff_side, handoff_summary
from engine.plan.kv_sizing import format_bytes, parse_memory
from engine.plan.loader import plan_to_dict
from engine.plan.resolved import ResolvedPlan
from engine.plan.validation import PlanCheck
from engine.suggest.figures import Cluster
from engine.suggest.hardware import DEVICE_NAMES, device_spec, parse_figure
from engine.suggest.models import planned_model
from engine.suggest.pd import suggest_pd, write_pair
from engine.suggest.suggest import OBJECTIVES, Request, suggest, write_plan

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
        "cpu_comm": res.cpu_comm or None,
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
            "draft_bytes_rank0": res.kv.draft_bytes,
        }
    spec = res.speculative
    if spec is not None:
        data["speculative"] = {
            "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_model": str(spec.draft.path) if spec.draft is not None else None,
            "draft_params": spec.draft.num_params if spec.draft is not None else None,
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


def handoff_picture(length: int, prefill: DcpSpec, decode: DcpSpec) -> Text:
    """Positions 0..length-1 coloured by the owning DCP rank on each side; '|' marks a side's virtual block."""
    text = Text()
    for row_start in range(0, length, 64):
        for label, spec in (("prefill", prefill), ("decode", decode)):
            span = dcp.tokens_per_virtual_block(spec.block_size, spec.dcp)
            text.append(f"{row_start:>6} {label:<8}", style="dim")
            for p in range(row_start, min(length, row_start + 64)):
                text.append("|" if p % span == 0 and p else " " if p == row_start else "", style="bold white")
                rank = dcp.owner(p, spec.interleave, spec.dcp)
                text.append(str(rank % 10), style=f"bold {RANK_COLORS[rank % len(RANK_COLORS)]}")
            text.append("\n")
    return text


def _render_handoff(console: Console, res: ResolvedPlan, positions: int) -> None:
    """A P/D plan's hand-off: where each decode rank's first block comes from, runs and descriptors per block, and
    per request at this interleave, at interleave = block size and at interleave 1."""
    summary = handoff_summary(res)
    if summary is None:
        console.print("[yellow]hand-off needs both plans' layouts (model folder absent or a plan invalid)[/]")
        return
    pre, dec = handoff_side(res.disagg.prefill), handoff_side(res)
    cache = "head-major" if dec.head_major else "token-major"

    def side(s: HandoffSide) -> str:
        p = s.layout
        return f"{s.name} (tp{p.tp} dcp{s.spec.dcp} I{s.spec.interleave} B{s.spec.block_size})"

    console.print(Text.assemble(("hand-off  ", "bold"), f"prefill {side(pre)} -> decode {side(dec)}, {cache} cache"))
    console.print(f"owner of positions 0..{positions - 1} on each side ('|' = a virtual block of that side):")
    console.print(handoff_picture(positions, pre.spec, dec.spec))
    across = f"{dec.layers} layers{' x K/V' if dec.kinds == 2 else ''}"
    for b in summary.blocks:
        sources = ", ".join(
            f"rank {r} block {blk} " + "".join(f"[{a}-{z}]" for a, z in slots) for r, blk, slots in b.sources
        )
        console.print(f"decode rank {b.rank}, block 0 ({b.local_tokens} tokens) <- prefill {sources}")
        runs, descriptors = (
            f"{n} {word}{'s' if n != 1 else ''}" for n, word in ((b.runs, "run"), (b.descriptors, "descriptor"))
        )
        console.print(
            f"    {runs} -> {descriptors} per block over all {across} "
            "(block-major cache: a whole block with all its heads is one)"
        )

    def counts(per_rank: list[int]) -> str:
        return " / ".join(f"{d:,}" for d in per_rank)

    console.print("descriptors per decode rank per request (prompt of N tokens; ranks separated by /):")
    for n, per_rank in summary.per_request.items():
        mib = max(b for _, b in per_rank) / 2**20
        console.print(f"  N={n}: {counts([d for d, _ in per_rank])}  ({mib:.2f} MiB per rank)")
    for interleave, per_n in summary.compare.items():
        why = " (= block size)" if interleave == dec.spec.block_size else ""
        line = "; ".join(f"N={n}: {counts(d)}" for n, d in per_n.items())
        console.print(f"  at interleave {interleave}{why}: {line}")


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
    console.print(f"collectives: {res.collectives_transport}")
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
    if res.speculative is not None and res.speculative.draft is not None:
        console.print(_draft_line(res))
    console.print(
        f"ownership of positions 0..{positions - 1} by DCP rank (interleave {p.interleave}, "
        f"block {c.block_size}, virtual block = {dcp.tokens_per_virtual_block(c.block_size, p.dcp)} tokens):"
    )
    console.print(ownership_picture(positions, c.block_size, p.interleave, p.dcp))
    if res.disagg is not None:
        _render_handoff(console, res, positions)


def _draft_line(res: ResolvedPlan) -> str:
    """Where the draft model runs and what it costs rank 0 (its weights at the plan's dtype, its KV cache)."""
    draft, kv = res.speculative.draft, res.kv
    try:
        weights = format_bytes(draft.num_params * dtype_bytes(res.dtype))
    except UserError:  # model.dtype is invalid: the check reports it
        weights = "?"
    line = f"draft model {draft.path} ({draft.info.num_layers} layers): unsharded on rank 0, weights {weights}"
    if kv is None:
        return line
    span = kv.block_size * kv.dcp
    return (
        f"{line} + KV {format_bytes(kv.draft_bytes)} = {kv.num_blocks} blocks x {span} tokens x "
        f"{kv.draft_bytes_per_block // span} B/token (rank 0's KV budget holds both caches)"
    )


MAX_POSITIONS = 65536  # the picture is a character per position


@app.command("show")
def show(
    args: Annotated[list[str], typer.Argument(help="A plan file, then KEY=VALUE overrides.")],
    positions: Annotated[int, typer.Option(help="How many positions the ownership picture shows.")] = 128,
) -> None:
    """Draw a plan's ranks, groups, KV memory per rank and token ownership."""
    plans, overrides = split_plans_and_overrides(args)
    if len(plans) != 1:
        raise typer.BadParameter("plan show takes exactly one plan file")
    if not 1 <= positions <= MAX_POSITIONS:
        raise typer.BadParameter(f"--positions must be 1..{MAX_POSITIONS} (got {positions})")
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


def _figure(option: str, text: str | None) -> float | None:
    return None if text is None else parse_figure(option, text)


@app.command("suggest")
def suggest_cmd(
    model: Annotated[str, typer.Argument(help="A checkpoint folder, a config.json, or a known model name.")],
    device: Annotated[str, typer.Option(help=f"Device kind: {', '.join(DEVICE_NAMES)}.")] = "cpu",
    devices: Annotated[int | None, typer.Option(help="Devices per node (default: 8 GPUs, or the CPU's cores).")] = None,
    nodes: Annotated[int, typer.Option(help="Nodes.")] = 1,
    context: Annotated[int, typer.Option(help="Tokens per sequence to plan for (prompt + output).")] = 4096,
    concurrency: Annotated[int, typer.Option(help="Sequences in flight over the whole cluster.")] = 1,
    dtype: Annotated[str, typer.Option(help="model.dtype of the plans (auto: fp32 on CPU, else bf16).")] = "auto",
    block_size: Annotated[int, typer.Option(help="cache.block_size of the plans.")] = 64,
    kv_cache_dtype: Annotated[
        str, typer.Option(help="cache.dtype of the plans (auto: the model's; fp8 = fp8_e4m3 | fp8_e5m2).")
    ] = "auto",
    kv_memory: Annotated[
        str | None, typer.Option(help="KV bytes per rank (e.g. 1GiB) instead of what is left.")
    ] = None,
    optimize: Annotated[str, typer.Option(help=f"Rank by {' | '.join(OBJECTIVES)}.")] = "capacity",
    memory: Annotated[str | None, typer.Option(help="Memory per device, e.g. 141GB (custom figure).")] = None,
    bandwidth: Annotated[str | None, typer.Option(help="Memory bandwidth, e.g. 4.8TB/s (custom figure).")] = None,
    flops: Annotated[str | None, typer.Option(help="Dense 16-bit FLOP/s, e.g. 989T (custom figure).")] = None,
    link_bandwidth: Annotated[str | None, typer.Option(help="Link bandwidth per rank, e.g. 450GB/s.")] = None,
    remeasure: Annotated[bool, typer.Option(help="--device cpu: measure again instead of the cached figures.")] = False,
    show_all: Annotated[bool, typer.Option("--all", help="Also list every rejected combination and why.")] = False,
    top: Annotated[int, typer.Option(help="Rows of the table.")] = 12,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    write: Annotated[
        str | None,
        typer.Option(
            help="Write the chosen plan as YAML to this file (--pd: the decode plan; the prefill plan "
            "goes beside it as <stem>_prefill.yaml)."
        ),
    ] = None,
    pick: Annotated[int, typer.Option(help="With --write: the row to write (1 = best).")] = 1,
    pd: Annotated[
        bool, typer.Option("--pd", help="Prefill -> decode pairs: both layouts, the hand-off and the decode step.")
    ] = False,
) -> None:
    """Every layout the plan checks accept for MODEL on a cluster, with its capacity and a roofline decode step."""
    if write is not None:
        writable_file(write, "--write")
    if top < 1:
        raise typer.BadParameter(f"--top must be at least 1 row (got {top})")
    planned = planned_model(model)
    spec = device_spec(
        device,
        planned.info,
        remeasure,
        memory=_figure("--memory", memory),
        bandwidth=_figure("--bandwidth", bandwidth),
        flops=_figure("--flops", flops),
        link=_figure("--link-bandwidth", link_bandwidth),
    )
    kv_bytes = None
    if kv_memory is not None:
        kv_bytes, _ = parse_memory(kv_memory)
        if kv_bytes is None:
            raise UserError(f"--kv-memory {kv_memory!r} must be a size such as 1GiB, not a fraction")
    cluster = Cluster(spec, devices if devices is not None else spec.devices_per_node, nodes)
    request = Request(planned, cluster, context, concurrency, dtype, block_size, kv_bytes, optimize, kv_cache_dtype)
    if pd:
        _suggest_pd(request, top, show_all, as_json, write, pick)
        return
    result = suggest(request)
    wrote = None
    if write is not None:
        chosen = _picked(result.accepted, pick, "layout")
        wrote = f"wrote {write_plan(chosen, write)} ({chosen.name}); check it with `dcpctl plan validate`"
    render = partial(render_suggestion, s=result, top=top, show_rejected=show_all)
    _show(result.accepted, as_json, partial(suggestion_to_dict, result), render, wrote)


def _show(
    accepted: list, as_json: bool, data: Callable[[], dict], render: Callable[[Console], None], wrote: str | None
) -> None:
    """Print a suggestion as JSON or as tables (then what --write wrote); exit 1 when nothing was accepted."""
    if as_json:
        typer.echo(json.dumps(data(), indent=2))
    else:
        console = Console()
        render(console)
        if wrote:
            console.print(wrote)
    if not accepted:
        raise typer.Exit(1)


def _picked(rows: list, pick: int, what: str):
    """Row `pick` (1 = best) of the accepted rows, for --write."""
    if not rows:
        raise UserError(f"no {what} was accepted, so there is nothing to write; --all says why")
    if not 1 <= pick <= len(rows):
        raise UserError(f"--pick {pick} is not a row: choose 1..{len(rows)}")
    return rows[pick - 1]


def _suggest_pd(request: Request, top: int, show_all: bool, as_json: bool, write: str | None, pick: int) -> None:
    result = suggest_pd(request)
    wrote = None
    if write is not None:
        decode, prefill = write_pair(_picked(result.accepted, pick, "P/D pair"), write)
        wrote = (
            f"wrote {decode} (decode, naming its prefill plan) and {prefill}; check them with "
            f"`dcpctl plan validate {decode}`"
        )
    render = partial(render_pd, s=result, top=top, show_rejected=show_all)
    _show(result.accepted, as_json, partial(pd_to_dict, result), render, wrote)
