"""dcpctl's environment variables: a bad value is a one-line error naming the variable, never ignored."""

from __future__ import annotations

import json

import pytest

from engine.checkpoints.pull import pull_model
from engine.distributed import collective_timeout_s
from engine.errors import UserError
from engine.kernels import cpu_isa
from engine.kernels.cpu_paths import kernels_wanted
from engine.plan.checks import validate_plan_file
from engine.suggest import measure


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_collective_timeout_must_be_positive_seconds(monkeypatch, value):
    monkeypatch.setenv("DCPCTL_COLLECTIVE_TIMEOUT", value)
    with pytest.raises(UserError, match=f"DCPCTL_COLLECTIVE_TIMEOUT='{value}' must be a positive number"):
        collective_timeout_s()
    monkeypatch.setenv("DCPCTL_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_timeout_s() == 2.5


def test_cpu_kernels_switch_takes_0_or_1(monkeypatch, make_plan, llama_folder):
    for value, wanted in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("DCPCTL_CPU_KERNELS", value)
        assert kernels_wanted() is wanted
    monkeypatch.setenv("DCPCTL_CPU_KERNELS", "bogus")
    report = validate_plan_file(make_plan(f"model: {{path: {llama_folder}}}\nlaunch: {{device: cpu}}\n"))
    [error] = report.problems.errors
    assert error.field == "DCPCTL_CPU_KERNELS" and "'bogus' is not 0" in error.message


def test_an_isa_above_the_cpus_is_noted(monkeypatch, make_plan, llama_folder):
    detected = cpu_isa.detect().detected
    above = [level for level in cpu_isa.LEVELS if cpu_isa.LEVELS.index(level) > cpu_isa.LEVELS.index(detected)]
    if not above:
        pytest.skip("this CPU has the highest level")
    monkeypatch.setenv("DCPCTL_CPU_ISA", above[-1])
    report = validate_plan_file(make_plan(f"model: {{path: {llama_folder}}}\nlaunch: {{device: cpu}}\n"))
    assert f"DCPCTL_CPU_ISA={above[-1]} is above this CPU's {detected}: it runs at {detected}" in report.problems.notes


def test_an_unwritable_model_cache_is_named(monkeypatch, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    monkeypatch.setenv("DCPCTL_CACHE", str(blocker / "models"))
    with pytest.raises(UserError, match="is a file, not a folder"):
        pull_model("smollm2-135m-instruct")


def test_cpu_figures_never_overwrite_another_file(monkeypatch, tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("my notes")
    monkeypatch.setenv("DCPCTL_CPU_FIGURES", str(other))
    with pytest.raises(UserError, match="is not dcpctl's CPU figures file"):
        measure._cached(measure.figures_file(), measure.machine_key())
    assert other.read_text() == "my notes"
    other.write_text(json.dumps({"machine": {"cpu": "another"}, "version": 1}))
    assert measure._cached(other, measure.machine_key()) == {}  # another machine's figures: measured again


def test_every_dcpctl_variable_the_code_names_is_registered():
    """engine/env_vars.py lists every DCPCTL_* variable named in the code (the docs' environment reference is
    generated from it), and each registered one is read by the module it names."""
    import re
    from pathlib import Path

    from engine.env_vars import ENV_VARS

    root = Path(__file__).resolve().parents[1]
    registered = {var.name: var for var in ENV_VARS}
    named: dict[str, set[str]] = {}
    for folder in ("engine", "dcpctl", "evals", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "env_vars.py":
                continue
            for name in re.findall(r"\bDCPCTL_[A-Z0-9_]+\b", path.read_text()):
                named.setdefault(name, set()).add(str(path.relative_to(root)))
    missing = sorted(set(named) - set(registered))
    assert not missing, f"add these to engine/env_vars.py: {missing} (named in {[named[m] for m in missing]})"
    for var in ENV_VARS:
        module = root / (var.read_by.replace(".", "/") + ".py")
        assert var.name in module.read_text(), f"{var.name}: {var.read_by} does not read it"
