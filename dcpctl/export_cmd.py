"""`dcpctl plan export` and `dcpctl plan import`: a plan to vLLM / SGLang / TensorRT-LLM settings and back."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.text import Text

from dcpctl.args import split_plans_and_overrides
from engine.errors import UserError
from engine.io_utils import atomic_write_text, writable_file
from engine.peers.export import ENGINE_NAMES, ENGINES, Export, Gap, plan_facts
from engine.peers.exporters import export_plan
from engine.peers.imports import import_words


def _command_lines(argv_text: str, argv: list[str]) -> str:
    """The command, one `--flag value` per line (shell continuation), ready to paste."""
    words = argv_text.split(" ")
    head_len = len(words) - len(argv)
    lines, current = [], words[: head_len + next((i for i, w in enumerate(argv) if w.startswith("--")), len(argv))]
    for word in words[len(current) :]:
        if word.startswith("--"):
            lines.append(" ".join(current))
            current = [word]
        else:
            current.append(word)
    lines.append(" ".join(current))
    return " \\\n  ".join(lines)


def _gap_line(gap: Gap) -> str:
    closest = f" (closest: {gap.closest})" if gap.closest else ""
    return f"#   {gap.field}: {gap.message} [{gap.reference}]{closest}"


def render_export(export: Export) -> str:
    """The export as text: a comment line, each instance's command (and YAML), then every gap as a comment."""
    name = ENGINE_NAMES[export.engine]
    out = [f"# {name}: plan {export.plan} ({export.source})"]
    if not export.runnable:
        out.append(f"# {name} cannot run this plan as it is: below is the closest layout it runs")
    for instance in export.instances:
        if instance.role != "serve":
            out.append(f"# {instance.role} instance")
        out.append(_command_lines(instance.command, instance.argv))
        if instance.config is not None:
            out.append(f"# {instance.config_file}:")
            out.append(yaml.safe_dump(instance.config, sort_keys=False).rstrip())
    blocking = [g for g in export.gaps if g.blocking]
    other = [g for g in export.gaps if not g.blocking]
    if blocking:
        out.append(f"# cannot run on {name}:")
        out += [_gap_line(g) for g in blocking]
    if other:
        out.append("# not carried over, or different there:")
        out += [_gap_line(g) for g in other]
    if export.checked:
        out.append(f"# checked against {export.checked}")
    return "\n".join(out)


def _check_installed(export: Export, python: str | None) -> None:
    """Put the installed engine's verdict (vLLM or SGLang) on every instance's command into `export.checked` (and
    a blocking gap for a rejection)."""
    if export.engine == "vllm":
        from engine.peers.vllm_check import PYTHON_ENV, check_serve_args, find_vllm_python

        found, check, script = find_vllm_python(python), check_serve_args, "vllm"
    else:
        from engine.peers.sglang_check import PYTHON_ENV, check_launch_args, find_sglang_python

        found, check, script = find_sglang_python(python), check_launch_args, "sglang"
    name = ENGINE_NAMES[export.engine]
    if found is None:
        export.checked = f"nothing: no {name} found (set ${PYTHON_ENV} or put `{script}` on PATH)"
        return
    verdicts = [check(found, i.argv, i.env) for i in export.instances]
    for instance, verdict in zip(export.instances, verdicts, strict=True):
        if not verdict.ok:
            role = "" if instance.role == "serve" else f"{instance.role}: "
            export.gaps.append(
                Gap(
                    "layout",
                    f"{role}the installed {name} rejects the command: {verdict.error}",
                    f"{name} {verdict.version} ({verdict.stage} check)",
                    blocking=True,
                )
            )
    ok = all(v.ok for v in verdicts)
    export.checked = f"{name} {verdicts[0].version} ({found}): " + (
        "accepted by its argument parser and config validation" if ok else "rejected (see above)"
    )


def export(
    args: Annotated[list[str], typer.Argument(help="A plan file, then KEY=VALUE overrides.")],
    to: Annotated[str, typer.Option("--to", help=f"The engine: {' | '.join(ENGINES)}.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the export as JSON.")] = False,
    allow_partial: Annotated[
        bool, typer.Option(help="When the engine cannot run the plan, print the closest it runs (exit 0).")
    ] = False,
    check: Annotated[
        bool, typer.Option(help="vLLM, SGLang: check the command against the installed engine (when one is found).")
    ] = True,
    vllm_python: Annotated[
        str | None, typer.Option(help="The python of a venv with vLLM (default: $DCPCTL_VLLM_PYTHON, else PATH).")
    ] = None,
    sglang_python: Annotated[
        str | None,
        typer.Option(help="The python of a venv with SGLang (default: $DCPCTL_SGLANG_PYTHON, else PATH)."),
    ] = None,
) -> None:
    """Print what vLLM, SGLang or TensorRT-LLM needs to run the same layout; exit 1 when it cannot."""
    plans, overrides = split_plans_and_overrides(args)
    if len(plans) != 1:
        raise typer.BadParameter("plan export takes exactly one plan file")
    if to not in ENGINES:
        raise UserError(f"--to {to!r} is not an engine dcpctl exports to: choose one of {', '.join(ENGINES)}")
    facts = plan_facts(plans[0], overrides)
    result = export_plan(to, facts)
    if to == "trtllm":
        result.checked = "nothing: dcpctl checks exports against an installed vLLM or SGLang only"
    elif not check:
        result.checked = "nothing (--no-check)"
    elif result.runnable or allow_partial:
        _check_installed(result, (vllm_python or facts.plan.engine.python) if to == "vllm" else sglang_python)
    if not result.runnable and not allow_partial:
        console = Console(stderr=True)
        for gap in (g for g in result.gaps if g.blocking):
            console.print(
                Text.assemble(
                    ("error: ", "bold red"),
                    f"{ENGINE_NAMES[to]} cannot run plan {result.plan}: {gap.message} [{gap.reference}]",
                ),
                highlight=False,
                soft_wrap=True,
            )
        console.print("--allow-partial prints the closest layout it runs, with the differences listed")
        raise typer.Exit(1)
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else render_export(result))


def import_plan(
    words: Annotated[
        list[str] | None,
        typer.Argument(
            help="After --: `vllm serve MODEL ...`, `python -m sglang.launch_server ...` or `trtllm-serve MODEL`."
        ),
    ] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="The plan file to write (YAML).")] = "",
    trtllm: Annotated[
        str | None, typer.Option(help="A TensorRT-LLM --extra_llm_api_options YAML to read instead of flags.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="The plan's name (default: the output file's stem).")] = None,
) -> None:
    """Write the dcpctl plan for another engine's command line (after --), reporting every flag not understood."""
    if not output:
        raise UserError("give the plan file to write with --output PLAN.yaml")
    writable_file(output, "--output")
    imported = import_words(words or [], trtllm)
    if "model.path" not in imported.settings:
        raise UserError("the command names no model: give it as vLLM/TensorRT-LLM's MODEL or SGLang's --model-path")
    source = shlex.join(words or []) + (f" (--trtllm {trtllm})" if trtllm else "")
    text = f"# imported by `dcpctl plan import` from: {source}\n"
    atomic_write_text(output, text + yaml.safe_dump(imported.plan_data(name or Path(output).stem), sort_keys=False))
    console = Console(stderr=True)
    console.print(
        f"wrote {output} ({len(imported.settings)} settings from {ENGINE_NAMES[imported.engine]}); check it with "
        f"`dcpctl plan validate {output}`",
        highlight=False,
        soft_wrap=True,
    )
    for note in imported.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    for word in imported.not_understood:
        console.print(f"not understood (left out of the plan): {word}", highlight=False, soft_wrap=True)
