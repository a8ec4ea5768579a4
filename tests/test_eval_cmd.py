"""`dcpctl eval gsm8k`: validation before launch, unreachable endpoints, --resume, a crashing engine, and
end-to-end comparisons of real `dcpctl run` servers on a tiny checkpoint through real lm-eval."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcpctl import eval_cmd
from engine.errors import UserError
from evals.launch import PlanServer, ServerError
from tests.oracle import write_plan

RUNNER = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    """Run `dcpctl eval ...` in-process; a UserError counts as exit 1 with its message (as cli.main does)."""
    result = RUNNER.invoke(eval_cmd.app, list(args))
    out = result.output
    if isinstance(result.exception, UserError):
        return 1, out + f"\nerror: {result.exception}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, out


def write_gsm8k(folder: Path, n_test: int = 4, n_train: int = 3) -> Path:
    """A tiny data dir in GSM8K's format (hand-made questions, not the synthetic generator's)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in ((3, 4), (10, 5), (7, 8), (2, 9), (6, 6), (11, 1), (4, 4))
    ]
    for name, part in (("test.jsonl", rows[:n_test]), ("train.jsonl", rows[n_test : n_test + n_train])):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def tiny_llama(tiny_models) -> Path:
    # 2 KV heads: tp1/dcp2 is the replica layout, like SmolLM2 on CPU.
    return tiny_models("llama", num_layers=1)


# --- fast ---------------------------------------------------------------------------------------------------


def test_invalid_plans_are_all_reported_and_nothing_launches(tmp_path, tiny_llama):
    good = write_plan(tmp_path, tiny_llama, name="good.yaml")
    bad = write_plan(tmp_path, tiny_llama, {"parallel.dcp": 2, "parallel.interleave": 3}, name="bad.yaml")
    nomodel = write_plan(tmp_path, tmp_path / "no-such-model", name="nomodel.yaml")
    out = tmp_path / "out"
    t0 = time.perf_counter()
    code, text = invoke(
        "gsm8k",
        "--compare",
        str(good),
        str(bad),
        str(nomodel),
        str(tmp_path / "missing.yaml"),
        "--data-dir",
        str(write_gsm8k(tmp_path / "data")),
        "--output",
        str(out),
    )
    assert code == 1
    assert "interleave" in text and "does not divide" in text  # bad.yaml
    assert "no-such-model" in text and "dcpctl model pull" in text  # nomodel.yaml
    assert "missing.yaml" in text and "does not exist" in text
    assert "nothing was launched" in text
    assert not out.exists()  # no server log, no report: nothing ran
    assert time.perf_counter() - t0 < 20


def test_overrides_apply_to_every_plan_before_launch(tmp_path, tiny_llama):
    a = write_plan(tmp_path, tiny_llama, name="a.yaml")
    b = write_plan(tmp_path, tiny_llama, {"parallel.dcp": 2}, name="b.yaml")
    code, text = invoke("gsm8k", str(a), str(b), "parallel.interleave=5", "--data-dir", str(tmp_path))
    assert code == 1
    assert text.count("parallel.interleave=5") >= 2  # reported for both plans


def test_unreachable_url_is_a_clear_error(tmp_path):
    url = closed_port_url()
    code, text = invoke("gsm8k", "--compare", url, "--data-dir", str(write_gsm8k(tmp_path / "data")))
    assert code == 1
    assert f"{url}: cannot reach the server" in text and "nothing was launched" in text


def test_unknown_task_and_bad_options_fail_before_launch(tmp_path, tiny_llama):
    plan = str(write_plan(tmp_path, tiny_llama))
    data = str(write_gsm8k(tmp_path / "data"))
    code, text = invoke("gsm8k", plan, "--task", "gsm9k", "--data-dir", data, "--output", str(tmp_path / "o1"))
    assert code == 1 and "unknown eval task 'gsm9k'" in text
    code, text = invoke("gsm8k", plan, "--resume")
    assert code == 1 and "--resume needs --output" in text
    code, text = invoke("gsm8k", plan, "--data-dir", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o2"))
    assert code == 1 and "does not exist" in text
    code, _ = invoke("gsm8k", plan, "--num-concurrent", "0")
    assert code == 2
    assert not any((tmp_path / o).exists() for o in ("o1", "o2"))


def test_hub_reachable_honours_offline_mode(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert eval_cmd.hub_reachable(timeout_s=0.1) is False


def test_data_dir_falls_back_to_env(monkeypatch, tmp_path):
    monkeypatch.delenv(eval_cmd.DATA_DIR_ENV, raising=False)
    assert eval_cmd.resolve_data_dir(None) is None
    monkeypatch.setenv(eval_cmd.DATA_DIR_ENV, str(tmp_path))
    assert eval_cmd.resolve_data_dir(None) == tmp_path
    assert eval_cmd.resolve_data_dir(tmp_path / "x") == tmp_path / "x"


def test_resume_only_reuses_matching_successful_runs(tmp_path, tiny_llama):
    from evals.results import EvalRun, Metric, SampleResult
    from evals.tasks import TaskSpec

    plan = write_plan(tmp_path, tiny_llama)
    from engine.plan.checks import validate_plan_file

    target = eval_cmd.Target(spec=str(plan), label="p", report=validate_plan_file(plan))
    task = TaskSpec(name="gsm8k_local", base="gsm8k", include_path=tmp_path, data_dir=tmp_path)
    opts = eval_cmd.EvalOptions(limit=2, num_fewshot=1)
    fp = eval_cmd.fingerprint(target, [], task, opts)
    run = EvalRun(
        label="p",
        task="gsm8k_local",
        metrics={"strict-match": Metric("exact_match", 0.5, 0.5)},
        samples=[SampleResult(doc_id=0, question="q", target="#### 1", generated=" 1")],
    )
    eval_cmd.save_result(tmp_path / "p", fp, eval_cmd.TargetResult(target=target, run=run, launch={"port": 1}))
    saved = eval_cmd.load_saved(tmp_path / "p", fp)
    assert saved is not None and saved.reused and saved.run.samples[0].generated == " 1"
    assert saved.run.metrics["strict-match"].value == 0.5
    other = eval_cmd.fingerprint(target, [], task, eval_cmd.EvalOptions(limit=3, num_fewshot=1))
    assert eval_cmd.load_saved(tmp_path / "p", other) is None  # different limit: evaluate again
    changed = eval_cmd.fingerprint(target, ["cache.block_size=32"], task, opts)
    assert eval_cmd.load_saved(tmp_path / "p", changed) is None
    failed = EvalRun.failure("p", "engine crashed")
    eval_cmd.save_result(tmp_path / "p", fp, eval_cmd.TargetResult(target=target, run=failed))
    assert eval_cmd.load_saved(tmp_path / "p", fp) is None  # failed runs are never reused


def test_server_that_exits_fails_fast_with_its_error(tmp_path):
    plan = write_plan(tmp_path, tmp_path / "no-such-model")
    server = PlanServer(plan, [], health_timeout_s=120, log_path=tmp_path / "server.log", label="broken")
    t0 = time.perf_counter()
    with pytest.raises(ServerError, match=r"plan broken: the server exited with code 1: .*no-such-model"), server:
        pass
    assert time.perf_counter() - t0 < 60
    assert not server.alive()
