"""`dcpctl run` input errors: one line, before anything is loaded or launched (CliRunner, in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcpctl.cli import app
from engine.errors import UserError
from engine.offline import read_prompts
from tests.oracle import write_plan

runner = CliRunner()


def _error(*args: str) -> str:
    """The UserError `dcpctl run ARGS` ends with (cli.main prints it as one line)."""
    result = runner.invoke(app, ["run", *args])
    assert isinstance(result.exception, UserError), result.output
    assert "\n" not in str(result.exception)
    return str(result.exception)


@pytest.fixture
def plan(tmp_path, tiny_models) -> str:
    return str(write_plan(tmp_path, tiny_models("llama", num_layers=1)))


def test_output_location_is_checked_before_the_run(tmp_path, plan):
    assert "is a folder" in _error(plan, "--prompt", "hi", "--output", str(tmp_path))
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is a file, not a folder" in _error(plan, "--prompt", "hi", "--output", str(afile / "o.jsonl"))
    if Path("/dev/null").is_char_device():
        assert "not a regular file" in _error(plan, "--prompt", "hi", "--output", "/dev/null")
        assert Path("/dev/null").is_char_device()


def test_prompt_errors(tmp_path, plan):
    bad = b"\xff\xfe\x80abc".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert "is not UTF-8 text" in _error(plan, "--prompt", bad)
    assert "is a folder: give the file of prompts" in _error(plan, "--prompts-file", str(tmp_path))
    result = runner.invoke(app, ["run", plan, "--prompt", "hi", "--seed", "-1"])
    assert result.exit_code == 2 and "--seed must be 0 or more" in result.output


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"prompt_token_ids": [True, 2]}, "a list of ints 'prompt_token_ids'"),
        ({"prompt": "a", "prompt_token_ids": [1, 2]}, "either 'prompt' or 'prompt_token_ids', not both"),
    ],
)
def test_jsonl_prompts_are_strict(tmp_path, record, match):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match=match):
        read_prompts(path)
