"""The `dcpctl` command: sub-apps for plans, models, runs, evals and benchmarks."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.text import Text

from dcpctl import bench_cmd, demo_cmd, eval_cmd, export_cmd, model_cmd, plan_cmd, run_cmd
from engine.errors import UserError

app = typer.Typer(
    help="Run and check decode context parallelism (DCP) layouts for LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
plan_cmd.app.command("export")(export_cmd.export)
plan_cmd.app.command("import")(export_cmd.import_plan)
app.add_typer(plan_cmd.app, name="plan")
app.add_typer(model_cmd.app, name="model")
app.command("run")(run_cmd.run)
app.add_typer(eval_cmd.app, name="eval")
app.command("demo")(demo_cmd.demo)
app.command("bench")(bench_cmd.bench)


def main() -> None:
    """Console entry point: user errors print one line and exit 1, never a traceback."""
    try:
        app(standalone_mode=True)
    except UserError as exc:
        Console(stderr=True).print(Text.assemble(("error: ", "bold red"), str(exc)), highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
