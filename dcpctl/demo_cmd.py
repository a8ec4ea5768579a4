"""`dcpctl demo`: SmolLM2 offline, the CPU plans, and gsm8k for the baseline against dcp 2 at three interleaves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from dcpctl.eval_view import library_output, run_comparison
from dcpctl.render import make_console
from engine.errors import UserError
from evals.evaluate import EvalOptions
from evals.runlog import RUN_LOG
from evals.tasks import hub_reachable, resolve_data_dir

MODEL_ALIAS = "smollm2-135m-instruct"
# The baseline first: every other column is compared against it.
DEMO_PLANS = ("smollm2_tp1_dcp1", "smollm2_tp1_dcp2_i1", "smollm2_tp1_dcp2_i16", "smollm2_tp1_dcp2_i64")
# Chosen so that the whole demo (4 launches, 4 evals of 15 questions, 5-shot) fits in 5 minutes on 2 CPU cores
# once set up: the same shots for every question (one prefix the engine's prefix cache computes once per plan) and
# at most 96 generated tokens. The batch of 15 decodes as many steps as its longest generation: the answers here
# take 20-90 tokens, the two that run away (repeating) would otherwise hold it for 256.
DEFAULT_LIMIT = 15
DEFAULT_MAX_GEN_TOKS = 96
SYNTHETIC_DIR = "synthetic_data"


def find_plans_dir(start: Path | None = None) -> Path:
    """The repo's plans/ folder: next to the installed package (editable install), else ./plans."""
    import dcpctl

    candidates = [Path(dcpctl.__file__).resolve().parent.parent / "plans", (start or Path.cwd()) / "plans"]
    for folder in candidates:
        if all((folder / "cpu" / f"{name}.yaml").is_file() for name in DEMO_PLANS):
            return folder
    raise UserError(
        f"cannot find the CPU plans ({', '.join(DEMO_PLANS)}) under {' or '.join(str(c / 'cpu') for c in candidates)}; "
        "run the demo from a dcpctl checkout (pip install -e .)"
    )


def demo_plans(plans_dir: Path | None = None) -> list[str]:
    """Paths of the demo's plans, the baseline first."""
    folder = plans_dir or find_plans_dir()
    return [str(folder / "cpu" / f"{name}.yaml") for name in DEMO_PLANS]


def choose_data_dir(option: Path | None, output: Path, n_test: int, console: Console) -> Path | None:
    """--data-dir / $DCPCTL_GSM8K_DIR, else None (the hub) when reachable, else a synthetic sample under output."""
    data_dir = resolve_data_dir(option)
    if data_dir is not None:
        return data_dir
    if hub_reachable():
        console.print("no --data-dir: using lm-eval's gsm8k task (data from the Hugging Face hub)")
        return None
    from evals.synthetic import write_synthetic_gsm8k

    folder = write_synthetic_gsm8k(output / SYNTHETIC_DIR, n_test=max(n_test, 50), n_train=20)
    console.print(
        "[bold yellow]no --data-dir, no $DCPCTL_GSM8K_DIR and the hub is unreachable: using a SYNTHETIC "
        f"arithmetic sample in GSM8K format ({folder}). It is NOT GSM8K; its accuracies say nothing about GSM8K. "
        "Pass --data-dir DIR with GSM8K test.jsonl/train.jsonl for the real thing.[/]",
        highlight=False,
    )
    return folder


def demo(
    limit: Annotated[int, typer.Option(help="Questions per plan (the default fits 5 minutes on 2 cores).")] = (
        DEFAULT_LIMIT
    ),
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Folder with GSM8K test.jsonl/train.jsonl (else $DCPCTL_GSM8K_DIR, else hub or synthetic)."),
    ] = None,
    output: Annotated[Path, typer.Option(help="Where the report, samples and server logs go.")] = Path("dcpctl-demo"),
    num_fewshot: Annotated[int, typer.Option(help="Few-shot examples per question.")] = 5,
    fixed_fewshot: Annotated[
        bool, typer.Option(help="The first train examples as every question's shots (the prefix cache reuses them).")
    ] = True,
    max_gen_toks: Annotated[int, typer.Option(help="Most tokens generated per question.")] = DEFAULT_MAX_GEN_TOKS,
    resume: Annotated[bool, typer.Option(help="Reuse plans already finished in --output.")] = False,
    verbose: Annotated[
        bool, typer.Option(help="Show lm-eval's and transformers' logs and bars (else they go to run.log in --output).")
    ] = False,
) -> None:
    """Pull SmolLM2-135M-Instruct, validate the CPU plans, and compare gsm8k on tp1/dcp1 against
    tp1/dcp2 with interleave 1, 16 and 64 (the block size): accuracy, per-question agreement, speed."""
    from engine.checkpoints.pull import pull_model

    console = make_console()
    console.rule("dcpctl demo: decode context parallelism on SmolLM2-135M-Instruct (CPU)")
    console.print(f"[bold]1/3[/] model {MODEL_ALIAS}")
    with library_output(output / RUN_LOG, verbose):  # the GGUF converter's bars and transformers' warnings
        pull_model(MODEL_ALIAS, console=console)
    plans = demo_plans()
    data = choose_data_dir(data_dir, output, limit, console)
    console.print(
        f"[bold]2/3[/] plans: {', '.join(DEMO_PLANS)}  [bold]3/3[/] gsm8k, {limit} questions, {num_fewshot}-shot"
    )
    opts = EvalOptions(
        data_dir=data, limit=limit, num_fewshot=num_fewshot, fixed_fewshot=fixed_fewshot, max_gen_toks=max_gen_toks
    )
    _, results = run_comparison(plans, [], opts, output=output, resume=resume, console=console, verbose=verbose)
    failed = [r.target.label for r in results if r.run.failed]
    if failed:
        Console(stderr=True).print(f"[bold red]error:[/] plan(s) failed: {', '.join(failed)}", highlight=False)
        raise typer.Exit(1)
