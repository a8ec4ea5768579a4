"""`dcpctl eval gsm8k`: validation before launch, unreachable endpoints, --resume, a crashing engine, and
end-to-end comparisons of real `dcpctl run` servers on a tiny checkpoint through real lm-eval."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from dcpctl import eval_cmd
from dcpctl.eval_view import run_comparison
from engine.errors import UserError
from evals import evaluate, tasks
from evals.launch import PlanServer, ServerStartError, sigterm_interrupts
from evals.targets import Target
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
    code, text = invoke("gsm8k", plan, "--max-gen-toks", "0", "--data-dir", data)
    assert code == 1 and "--max-gen-toks must be at least 1 (got 0)" in text
    code, text = invoke("gsm8k", plan, "--data-dir", data, "--output", data + "/test.jsonl")
    assert code == 1 and "is a file, not a folder" in text  # --output is checked first, not blamed on --data-dir
    code, text = invoke("gsm8k", plan, "--data-dir", data + "/test.jsonl")
    assert code == 1 and f"is a file; pass the folder holding test.jsonl and train.jsonl ({data})" in text
    code, text = invoke("gsm8k", plan, "--data-dir", data, "--num-fewshot", "-1")
    assert code == 1 and "--num-fewshot must be 0 or more (got -1)" in text
    code, text = invoke("gsm8k", plan, "--data-dir", data, "--health-timeout", "nan")
    assert code == 1 and "--health-timeout must be a positive number of seconds (got nan)" in text
    code, text = invoke("gsm8k", plan, "--data-dir", data, "--num-fewshot", "50")
    assert code == 1 and "--num-fewshot 50 is more than the 3 examples in" in text
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "test.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    (binary / "train.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    code, text = invoke("gsm8k", plan, "--data-dir", str(binary))
    assert code == 1 and "test.jsonl is not UTF-8 text" in text
    assert not any((tmp_path / o).exists() for o in ("o1", "o2"))


def test_hub_reachable_honours_offline_mode(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert tasks.hub_reachable(timeout_s=0.1) is False


def test_data_dir_falls_back_to_env(monkeypatch, tmp_path):
    monkeypatch.delenv(tasks.DATA_DIR_ENV, raising=False)
    assert tasks.resolve_data_dir(None) is None
    monkeypatch.setenv(tasks.DATA_DIR_ENV, str(tmp_path))
    assert tasks.resolve_data_dir(None) == tmp_path
    assert tasks.resolve_data_dir(tmp_path / "x") == tmp_path / "x"


def test_resume_only_reuses_matching_successful_runs(tmp_path, tiny_llama):
    from evals.results import EvalRun, Metric, SampleResult
    from evals.tasks import TaskSpec

    plan = write_plan(tmp_path, tiny_llama)
    from engine.plan.checks import validate_plan_file

    target = Target(spec=str(plan), label="p", resolved=validate_plan_file(plan).require_valid())
    task = TaskSpec(name="gsm8k_local", base="gsm8k", include_path=tmp_path, data_dir=tmp_path)
    opts = evaluate.EvalOptions(limit=2, num_fewshot=1)
    fp = evaluate.fingerprint(target, [], task, opts)
    run = EvalRun(
        label="p",
        task="gsm8k_local",
        metrics={"strict-match": Metric("exact_match", 0.5, 0.5)},
        samples=[SampleResult(doc_id=0, question="q", target="#### 1", generated=" 1")],
    )
    evaluate.save_result(tmp_path / "p", fp, evaluate.TargetEval(target=target, run=run, launch={"port": 1}))
    saved = evaluate.load_saved(tmp_path / "p", fp)
    assert saved is not None and saved.reused and saved.run.samples[0].generated == " 1"
    assert saved.run.metrics["strict-match"].value == 0.5
    other = evaluate.fingerprint(target, [], task, evaluate.EvalOptions(limit=3, num_fewshot=1))
    assert evaluate.load_saved(tmp_path / "p", other) is None  # different limit: evaluate again
    changed = evaluate.fingerprint(target, ["cache.block_size=32"], task, opts)
    assert evaluate.load_saved(tmp_path / "p", changed) is None
    failed = EvalRun.failure("p", "engine crashed")
    evaluate.save_result(tmp_path / "p", fp, evaluate.TargetEval(target=target, run=failed))
    assert evaluate.load_saved(tmp_path / "p", fp) is None  # failed runs are never reused


def test_server_that_exits_fails_fast_with_its_error(tmp_path):
    plan = write_plan(tmp_path, tmp_path / "no-such-model")
    server = PlanServer(plan, [], health_timeout_s=120, log_path=tmp_path / "server.log", label="broken")
    t0 = time.perf_counter()
    with pytest.raises(ServerStartError, match=r"plan broken: the server exited with code 1: .*no-such-model"), server:
        pass
    assert time.perf_counter() - t0 < 60
    assert not server.alive()


def test_a_server_whose_picked_port_was_taken_before_it_bound_starts_again_on_another(
    tmp_path, tiny_llama, monkeypatch
):
    """The port a PlanServer picks is free when picked, and the server binds it seconds later (after its imports):
    another process may take it between the two. The server exits saying so and starts again on a new free port. A
    port the caller chose is theirs: taken, it is the server's error."""
    from engine.serving import plan_server

    plan = write_plan(tmp_path, tiny_llama)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks, pick = iter([taken]), plan_server.free_port
        monkeypatch.setattr(plan_server, "free_port", lambda host: next(picks, None) or pick(host))
        server = PlanServer(plan, [], log_path=tmp_path / "picked.log")
        assert server.port == taken
        with server:
            assert server.port != taken and server.healthy()
        chosen = PlanServer(plan, [], port=taken, log_path=tmp_path / "chosen.log", label="chosen")
        in_use = rf"plan chosen: .*serve\.port={taken} on 127\.0\.0\.1 is already in use"
        with pytest.raises(ServerStartError, match=in_use), chosen:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_to_eval_stops_the_server_it_launched(tmp_path, tiny_llama, sig):
    """SIGTERM and SIGINT: the eval stops its server on the way out. SIGKILL (the OOM killer's way) runs no clean-up
    at all: the server notices its launcher is gone and stops itself."""
    import subprocess
    import sys

    import psutil

    plan = write_plan(tmp_path, tiny_llama, name="tp1.yaml")
    data, out = write_gsm8k(tmp_path / "data"), tmp_path / "out"
    command = [sys.executable, "-m", "dcpctl.cli", "eval", "gsm8k", str(plan), "--data-dir", str(data)]
    command += ["--limit", "4", "--num-fewshot", "1", "--output", str(out)]
    proc = subprocess.Popen(  # SIGINT as in a terminal, even when this run inherited it ignored (nohup, `&`)
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    server = []
    try:
        lines = []
        for line in proc.stdout:  # plain progress lines (not a terminal); lm-eval is imported once healthy
            lines.append(line)
            if "healthy in" in line:
                break
        server = [p for p in psutil.Process(proc.pid).children(recursive=True) if "engine.serve_entry" in p.cmdline()]
        assert len(server) == 1, "".join(lines)
        proc.send_signal(sig)
        assert proc.wait(timeout=90) != 0  # interrupted, not finished
        _, alive = psutil.wait_procs(server, timeout=30 if sig == signal.SIGKILL else 5)
        assert not alive, f"the plan server outlived `dcpctl eval` ({sig.name})"
    finally:
        if proc.poll() is None:
            proc.kill()
        for leftover in server:  # a failed run leaves no orphan behind
            with contextlib.suppress(psutil.Error):
                leftover.kill()


def test_ctrl_c_inside_asyncio_run_raises_even_when_the_coroutine_swallows_the_cancellation():
    """lm-eval sends its requests under `asyncio.run`, whose own Ctrl-C handling cancels the task; a library that
    swallows the cancellation made an interrupted eval finish with exit 0. Inside `sigterm_interrupts` it raises."""
    import asyncio
    import contextlib

    async def requests_that_swallow_cancellation() -> str:
        signal.raise_signal(signal.SIGINT)
        for _ in range(50):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)
        return "finished"

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's, even under nohup
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
            asyncio.run(requests_that_swallow_cancellation())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_library_output_goes_to_the_run_log_with_bars_collapsed(tmp_path, capsys):
    import logging
    import sys

    from evals.runlog import library_output_to

    log = tmp_path / "out" / "run.log"
    lm_eval_logger = logging.getLogger("lm_eval")
    before = list(lm_eval_logger.handlers)
    with library_output_to(log):
        logging.getLogger("lm_eval.models").info("Using max length 2048")
        logging.getLogger("transformers").warning("a transformers warning")
        for k in range(1, 4):  # what tqdm writes: carriage-return updates, then a newline
            sys.stderr.write(f"\rRequesting API: {k}/3")
        sys.stderr.write("\n")
        sys.stderr.write("half a line")
    assert capsys.readouterr().err == ""  # nothing reached the terminal
    lines = log.read_text().splitlines()
    assert any(line.endswith("INFO lm_eval.models: Using max length 2048") for line in lines)
    assert any(line.endswith("WARNING transformers: a transformers warning") for line in lines)
    assert "Requesting API: 3/3" in lines and not any("1/3" in line for line in lines)
    assert lines[-1] == "half a line"
    assert lm_eval_logger.handlers == before  # restored


def test_quiet_run_writes_no_log(tmp_path):
    from evals.runlog import library_output_to

    with library_output_to(tmp_path / "out" / "run.log"):
        pass
    assert not (tmp_path / "out").exists()


def _drive(feed) -> None:
    line = feed.target("tp1", total=0)
    line.status("launching")
    line.status("evaluating 3 questions")
    line.expect(3)
    line.throughput(42.0)
    for _ in range(3):
        line.advance()
    line.finish("done, 3 questions")
    feed.target("dcp2", total=3).finish("the server exited with code 1", failed=True)


def test_progress_on_a_terminal_is_one_bar_per_target():
    import io

    from rich.console import Console

    from dcpctl.render import ProgressFeed

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    with ProgressFeed(console) as feed:
        _drive(feed)
    text = console.file.getvalue()
    assert "tp1: done, 3 questions" in text and "3/3" in text and "42.0 tok/s" in text
    assert "dcp2: FAILED" in text and "exited with code 1" in text


def test_progress_in_a_log_is_plain_lines(monkeypatch):
    import io

    from rich.console import Console

    from dcpctl import render

    monkeypatch.setattr(render, "PLAIN_PROGRESS_EVERY_S", 0.0)
    console = Console(file=io.StringIO(), width=120)
    with render.ProgressFeed(console) as feed:
        _drive(feed)
    lines = console.file.getvalue().splitlines()
    assert lines[:3] == ["tp1: launching", "tp1: evaluating 3 questions", "tp1: 1/3 done, 42.0 tok/s, 0:00:00"]
    assert (
        lines[5].startswith("tp1: done, 3 questions (0:00:0")
        and lines[6] == "dcp2: FAILED — the server exited with code 1"
    )
    assert not any("\r" in line or "\x1b" in line for line in lines)


# --- slow: real `dcpctl run` servers on a tiny checkpoint, real lm-eval --------------------------------------


def _plans(tmp_path: Path, model: Path) -> tuple[str, str]:
    tp1 = write_plan(tmp_path, model, name="tp1.yaml")
    dcp2 = write_plan(tmp_path, model, {"parallel.dcp": 2, "parallel.interleave": 4}, name="dcp2_i4.yaml")
    return str(tp1), str(dcp2)


@pytest.mark.slow
@pytest.mark.multiproc
def test_compare_tp1_and_dcp2_end_to_end_then_resume(tmp_path, tiny_llama):
    tp1, dcp2 = _plans(tmp_path, tiny_llama)
    data, out = str(write_gsm8k(tmp_path / "data")), tmp_path / "out"
    args = ["gsm8k", "--compare", tp1, dcp2, "--data-dir", data, "--limit", "3", "--num-fewshot", "1"]
    code, text = invoke(*args, "--output", str(out))
    assert code == 0, text
    assert "gsm8k (local data)" in text and "text agreement" in text

    cmp = json.loads((out / "comparison.json").read_text())
    assert [c["label"] for c in cmp["columns"]] == ["tp1", "dcp2_i4"] and cmp["n_common"] == 3
    assert cmp["n_shot"] == 1 and cmp["mode"] == "completions"
    base, dcp = cmp["columns"]
    assert not base["failed"] and not dcp["failed"]
    # fp32, wide-margin tiny model: DCP must reproduce the baseline's generations exactly
    assert dcp["text_agreement"]["same"] == dcp["text_agreement"]["total"] == 3
    assert all(a["same"] == 3 for a in dcp["answer_agreement"].values())
    assert dcp["disagreements"] == [] and all(d == 0 for d in dcp["delta"].values())
    assert all(c["tokens_per_s"] and c["generated_tokens"] > 0 for c in cmp["columns"])
    md = (out / "comparison.md").read_text()
    assert "| text agreement |" in md and "3/3 (100.0%)" in md
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("tp1", "dcp2_i4"):
        rows = [json.loads(line) for line in (out / name / "samples.jsonl").read_text().splitlines()]
        assert [r["doc_id"] for r in rows] == [0, 1, 2] and all(r["gold"] for r in rows)
        assert len((out / name / "lm_eval" / "lm_eval_samples.jsonl").read_text().splitlines()) == 6  # 2 filters
        assert "serving" in (out / name / "server.log").read_text()
        saved = json.loads((out / name / evaluate.RUN_FILE).read_text())
        assert 0 < saved["launch"]["time_to_healthy_s"] < 120 and saved["launch"]["exit_code"] in (0, 130)
    samples = [json.loads(line) for line in (out / "tp1" / "samples.jsonl").read_text().splitlines()]
    assert [s["generated"] for s in samples] == [
        json.loads(line)["generated"] for line in (out / "dcp2_i4" / "samples.jsonl").read_text().splitlines()
    ]

    # --resume: both plans are reused, nothing is launched, the report is the same
    logs = {n: (out / n / "server.log").stat().st_mtime_ns for n in ("tp1", "dcp2_i4")}
    t0 = time.perf_counter()
    code, text = invoke(*args, "--output", str(out), "--resume")
    assert code == 0, text
    assert text.count("reused") >= 2
    assert time.perf_counter() - t0 < 30
    assert {n: (out / n / "server.log").stat().st_mtime_ns for n in logs} == logs
    again = json.loads((out / "comparison.json").read_text())
    assert [c["text_agreement"] for c in again["columns"]] == [c["text_agreement"] for c in cmp["columns"]]


def _kill_rank1_after_first_tokens(server: PlanServer) -> None:
    """Simulate an engine crash: SIGKILL rank 1 of `server` once its first request is generating."""

    def watch() -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while server.alive():
                if client.get(f"{server.base_url}/v1/engine/stats").json()["generated_tokens"] > 0:
                    break
                time.sleep(0.02)
        for proc in server.processes():
            if "engine.worker" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == "1":
                proc.send_signal(signal.SIGKILL)
                KILLED.append(proc.pid)

    if server.label == "dcp2_i4":
        threading.Thread(target=watch, daemon=True).start()


KILLED: list[int] = []


@pytest.mark.slow
@pytest.mark.multiproc
def test_engine_crash_mid_eval_fails_that_column_only(tmp_path, tiny_llama):
    from rich.console import Console

    tp1, dcp2 = _plans(tmp_path, tiny_llama)
    after = str(write_plan(tmp_path, tiny_llama, {"cache.block_size": 32}, name="after.yaml"))
    out = tmp_path / "out"
    opts = evaluate.EvalOptions(data_dir=write_gsm8k(tmp_path / "data"), limit=4, num_fewshot=1)
    console = Console(record=True, width=200)
    KILLED.clear()
    cmp, results = run_comparison(
        [tp1, dcp2, after], [], opts, output=out, console=console, on_server=_kill_rank1_after_first_tokens
    )
    assert len(KILLED) == 1
    base, crashed, later = cmp.columns
    assert not base.failed and not later.failed and crashed.failed
    assert crashed.error.startswith("the server exited with code") and "during the eval" in crashed.error
    assert later.text_agreement is not None and later.text_agreement.total == 4  # the plan after the crash ran
    data = json.loads((out / "comparison.json").read_text())
    assert [c["failed"] for c in data["columns"]] == [False, True, False]
    assert "FAILED" in (out / "comparison.md").read_text() and "dcp2_i4" in (out / "comparison.md").read_text()
    assert len((out / "tp1" / "samples.jsonl").read_text().splitlines()) == 4  # finished plans' results kept
    assert "FAILED" in console.export_text()
    for r in results:  # every rank of every server is gone
        assert r.launch.get("exit_code") is not None
    assert not any(_pid_alive(pid) for pid in KILLED)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_url_target_in_chat_mode_against_real_server(tmp_path, tiny_llama):
    """lm-eval's local-chat-completions against a running `dcpctl run`, given as a URL."""
    tp1 = write_plan(tmp_path, tiny_llama, name="served.yaml")
    data = str(write_gsm8k(tmp_path / "data"))
    with PlanServer(tp1, [], log_path=tmp_path / "server.log") as server:
        assert server.time_to_healthy_s and server.time_to_healthy_s > 0
        code, text = invoke(
            "gsm8k",
            f"{server.base_url}/v1",
            "--apply-chat-template",
            "--data-dir",
            data,
            "--limit",
            "2",
            "--num-fewshot",
            "1",
            "--max-gen-toks",
            "32",
            "--output",
            str(tmp_path / "out"),
        )
        assert server.alive()  # a URL target is evaluated as it is, never launched or stopped
    assert code == 0, text
    cmp = json.loads((tmp_path / "out" / "comparison.json").read_text())
    (col,) = cmp["columns"]
    assert col["label"] == server.base_url and col["mode"] == "chat" and col["n_samples"] == 2
    assert not col["failed"] and col["generated_tokens"] > 0
    assert server.returncode == 0  # SIGINT stopped it cleanly


# --- slow: a tie flip and a real divergence, forced through the checkpoints ----------------------------------


def _with_lm_head(model: Path, out: Path, edit) -> Path:
    """A copy of `model` whose lm_head weight is edited in place by `edit(weight)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(model / "model.safetensors")
    edit(weights["lm_head.weight"])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow
def test_tie_flip_and_wrong_plan_are_told_apart_and_strict_fails_on_the_wrong_one(tmp_path, tiny_llama):
    """Token B's lm_head row is token A's scaled by 1 -/+ 1e-5 in the baseline/flip checkpoints: where A is the
    greedy choice the two are a near-tie broken oppositely (a tie flip, by construction). The wrong checkpoint
    negates both rows, so neither can be chosen there (a real divergence)."""
    from evals.divergence import TIE_FLIP, TIE_MARGINS, UNEXPLAINED

    data = str(write_gsm8k(tmp_path / "data"))
    common = ["--data-dir", data, "--limit", "2", "--num-fewshot", "1", "--max-gen-toks", "6"]
    orig = write_plan(tmp_path, tiny_llama, name="orig.yaml")
    code, text = invoke("gsm8k", str(orig), *common, "--output", str(tmp_path / "probe"))
    assert code == 0, text
    probe = json.loads((tmp_path / "probe" / "orig" / evaluate.RUN_FILE).read_text())["run"]["samples"][0]["trace"]
    a = probe["ids"][0]  # the baseline's first generated token of doc 0
    assert all(probe["logprobs"][0] - lp > 100 * TIE_MARGINS["float32"] for _, lp in probe["rivals"][0])
    b = max(set(range(512)) - {a} - {i for i, _ in probe["rivals"][0]})

    def near(scale: float):
        def edit(w):
            w[b] = w[a] * scale

        return edit

    def negated(w):
        w[b] = -w[a] * (1 - 1e-5)
        w[a] = -w[a]

    plans = {
        name: write_plan(tmp_path, _with_lm_head(tiny_llama, tmp_path / f"m_{name}", edit), name=f"{name}.yaml")
        for name, edit in (("base", near(1 - 1e-5)), ("flip", near(1 + 1e-5)), ("wrong", negated))
    }
    out = tmp_path / "out"
    code, text = invoke("gsm8k", *map(str, plans.values()), *common, "--output", str(out), "--strict")
    assert code == 1, text
    assert "unexplained divergence" in text and "wrong vs base, doc 0" in text
    assert "unexplained divergences from the baseline (wrong: " in text and "--strict fails" in text

    cmp = json.loads((out / "comparison.json").read_text())
    _, flip, wrong = cmp["columns"]
    flips = {d["doc_id"]: d["divergence"] for d in flip["disagreements"]}
    assert flips and all(d["kind"] == TIE_FLIP for d in flips.values()) and flip["unexplained_divergences"] == 0
    assert flips[0]["position"] == 0 and {flips[0]["baseline_token"], flips[0]["plan_token"]} == {a, b}
    assert (
        0 <= flips[0]["baseline_gap"] <= TIE_MARGINS["float32"] and 0 <= flips[0]["plan_gap"] <= TIE_MARGINS["float32"]
    )
    wrongs = {d["doc_id"]: d["divergence"] for d in wrong["disagreements"]}
    assert wrongs[0]["kind"] == UNEXPLAINED and wrongs[0]["position"] == 0 and wrong["tie_flips"] == 0
    assert wrongs[0]["plan_token"] not in (a, b) and wrongs[0]["plan_gap"] > 1.0
    md = (out / "comparison.md").read_text()
    assert "flip vs base" in md and "| tie flip |" in md and "**unexplained**" in md

    # The tie flip alone passes --strict (both plans reused from the run above).
    code, text = invoke(
        "gsm8k", str(plans["base"]), str(plans["flip"]), *common, "--output", str(out), "--resume", "--strict"
    )
    assert code == 0, text
    assert text.count("reused") >= 2 and "unexplained divergence " not in text


@pytest.mark.slow
def test_a_speculating_target_reports_the_acceptance_of_its_eval_alone(tmp_path, echo_models):
    """A plan without speculation (launched) against a running ngram server (a URL, already used by a warm-up
    request): the same generations, and the server's acceptance counted over the eval's requests only, in the
    table and the result files; the plan without speculation has none."""
    folder = echo_models("llama", num_layers=1)
    ngram = {
        "speculative_config.method": "ngram",
        "speculative_config.num_speculative_tokens": 4,
        "speculative_config.prompt_lookup_min": 1,
        "speculative_config.prompt_lookup_max": 3,
    }
    plain = write_plan(tmp_path, folder, name="plain.yaml")
    spec = write_plan(tmp_path, folder, ngram, name="ngram.yaml")
    data, out = str(write_gsm8k(tmp_path / "data")), tmp_path / "out"
    warm_up = {"prompt": "one two one two one two", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with PlanServer(spec, [], log_path=tmp_path / "server.log") as server, httpx.Client(trust_env=False) as http:
        http.post(f"{server.base_url}/v1/completions", json=warm_up, timeout=60).raise_for_status()
        before = http.get(f"{server.base_url}/v1/engine/stats").json()["speculative"]
        assert before["proposed"] > 0
        args = ["--data-dir", data, "--limit", "3", "--num-fewshot", "1", "--max-gen-toks", "48"]
        code, text = invoke("gsm8k", "--compare", str(plain), server.base_url, *args, "--output", str(out))
        after = http.get(f"{server.base_url}/v1/engine/stats").json()["speculative"]
    assert code == 0, text
    assert "speculation: proposals accepted" in text and "speculation: tokens per verification" in text
    cmp = json.loads((out / "comparison.json").read_text())
    base, col = cmp["columns"]
    assert col["text_agreement"]["same"] == col["text_agreement"]["total"] == 3
    assert base["speculation"] is None
    measured = {k: after[k] - before[k] for k in ("proposed", "accepted", "verifications")}
    assert {k: col["speculation"][k] for k in measured} == measured
    assert measured["proposed"] > measured["accepted"] > 0
    assert col["speculation"]["acceptance_rate"] == measured["accepted"] / measured["proposed"]
    md = (out / "comparison.md").read_text()
    assert f"| speculation: proposals accepted | — | {col['speculation']['acceptance_rate']:.0%} |" in md
    saved = json.loads(next(out.glob("*127.0.0.1*/" + evaluate.RUN_FILE)).read_text())
    assert saved["run"]["speculation"] == col["speculation"]
