"""The docs site builds with `mkdocs build --strict` (a broken link or anchor, a page missing from the navigation,
a command whose shown output fails, or a plan field without a description fails it), and its reference pages
are generated from the code."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generate():
    """The docs' build hook, imported as mkdocs imports it."""
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "hooks" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_build_strict_without_warnings(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert "WARNING" not in log, log
    for page in ("reference/plan", "reference/cli", "reference/server", "reference/environment", "results"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_every_plan_field_is_documented_with_its_default(generate):
    from engine.plan import schema

    rows = {row["key"]: row for row in generate.plan_fields()}
    leaves = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(factory):
                walk(factory, f"{prefix}{f.name}.")
            else:
                leaves.append(f"{prefix}{f.name}")

    walk(schema.Plan, "")
    assert sorted(rows) == sorted(leaves)
    assert rows["parallel.interleave"]["default"] == "1"
    assert "--cp-kv-cache-interleave-size" in rows["parallel.interleave"]["vllm"]
    assert "parallel.cp_kv_cache_interleave_size" in rows["parallel.interleave"]["vllm"]
    assert rows["model.path"]["default"] == "required"
    assert rows["parallel.dcp_comm_backend"]["choices"] == "`auto`, `ag_rs`, `a2a`"


def test_a_plan_field_without_a_description_fails_the_build(generate, monkeypatch):
    from mkdocs.exceptions import PluginError

    # the loader imported before the patch binds the real Plan; imported first under it, it would keep this test's
    # Plan for the worker's later tests (their `load_plan` failed on its local ServeSection under xdist)
    from engine.plan import loader, schema  # noqa: F401

    @dataclasses.dataclass
    class ServeSection(schema.ServeSection):
        workers: int = 1

    @dataclasses.dataclass
    class Plan(schema.Plan):
        serve: ServeSection = dataclasses.field(default_factory=ServeSection)

    monkeypatch.setattr(schema, "Plan", Plan)
    with pytest.raises(PluginError, match=r"plan field serve.workers has no description"):
        generate.plan_fields()


def test_cli_reference_lists_every_command_and_option(generate):
    import typer.main

    from dcpctl.cli import app

    page = generate.cli_reference()
    for path, command in generate._commands(typer.main.get_command(app), ["dcpctl"]):
        if not getattr(command, "commands", None):
            assert f"## `{' '.join(path)}`" in page
            for param in command.params:
                if not type(param).__name__.endswith("Argument") and not param.hidden:
                    assert f"`{' / '.join([*param.opts, *param.secondary_opts])}`" in page


def test_server_reference_lists_every_route_with_its_errors(generate):
    page = generate.server_reference()
    for route in ("GET /health", "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/kv_transfer/claim"):
        assert f"### `{route}`" in page
    assert "413: a request body over the size limit" in page
    assert "| `n` | integer | `1` | >= 1, <= 128 |" in page


def test_shown_command_output_is_the_commands_own(generate):
    block = generate.command_block("plan show plans/cpu/smollm2_tp1_dcp2_i16.yaml --positions 64", "ownership of")
    assert block.splitlines()[-2] == "     0  0000000000000000111111111111111100000000000000001111111111111111"
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="exited 1, not 0"):
        generate.command_block("plan validate plans/cpu/smollm2_tp1_dcp1.yaml parallel.interleave=48")
