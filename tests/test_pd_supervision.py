"""`dcpctl run` supervising a P/D deployment, for real: `python -m engine.serve_entry PD_PLAN` (what `dcpctl run`
serves) on a tiny checkpoint, its instances SIGKILLed. A dead instance is reported on the terminal at once (which
one, how it died, its log), the router answers 503 with Retry-After while it is down, and once it is restarted the
router is healthy again, requests give HF's greedy tokens, nothing is held and the stats count the restart. A stream
the decode instance breaks off ends with an error event that the router logs. Restarts used up, or
`disagg.max_restarts=0`, or a dead router end the run with exit code 1 and a clear message, leaving no process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from engine.serving.plan_server import PlanServer
from tests.oracle import hf_greedy, prompt_ids
from tests.test_pd import fault_plan, wait_for

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

NEW_TOKENS = 4
# Fault injection, in the prefill instance's process only: once the test creates the file $DCPCTL_TEST_ENGINE_FAULT,
# the next engine step raises (the engine fails; the process lives on) and the file goes.
ENGINE_FAULT_HOOK = """
import os, sys
if "engine.serve_entry" in sys.orig_argv and "prefill" in sys.orig_argv and "DCPCTL_TEST_ENGINE_FAULT" in os.environ:
    from pathlib import Path
    from engine.runtime.model_runner import ModelRunner
    armed, original = Path(os.environ["DCPCTL_TEST_ENGINE_FAULT"]), ModelRunner.execute
    def execute(self, step):
        if armed.exists():
            armed.unlink()
            raise RuntimeError("injected engine fault")
        return original(self, step)
    ModelRunner.execute = execute
"""


def start(tmp_path: Path, folder: Path, disagg: dict | None = None, env: dict | None = None) -> PlanServer:
    """The fault tests' P/D plan served as `dcpctl run` serves it, healthy."""
    server = PlanServer(
        fault_plan(tmp_path, folder, disagg), log_path=tmp_path / "run.log", health_timeout_s=300, env=env
    )
    server.start()
    try:
        server.wait_healthy()
        # the router answers as soon as it sees both instances healthy, a poll before the deployment does: supervision
        # (and so a restart of a killed instance) starts with the deployment's banner
        wait_for(lambda: "logs in " in terminal(server), timeout_s=60, what="deployment banner")
    except BaseException:
        server.stop()
        raise
    return server


def piece(run: PlanServer, role: str) -> psutil.Process:
    """The process serving one piece of the deployment (`--role prefill|decode|router`)."""
    found = [p for p in run.processes() if "engine.serve_entry" in p.cmdline() and role in p.cmdline()]
    assert len(found) == 1, [p.cmdline() for p in run.processes()]
    return found[0]


def kill_tree(proc: psutil.Process) -> None:
    """SIGKILL a piece with all its processes at once (torchrun and its ranks too): the whole instance dies."""
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            p.kill()


def terminal(run: PlanServer) -> str:
    return run.log_path.read_text()


def logs_dir(run: PlanServer) -> Path:
    return Path(re.search(r"logs in (\S+)\)", terminal(run)).group(1))


def body(ids: list[int], **extra) -> dict:
    return {"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


def tokens(client: httpx.Client, url: str, ids: list[int]) -> list[int]:
    response = client.post(f"{url}/v1/completions", json=body(ids, return_token_ids=True))
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def settled(client: httpx.Client, url: str) -> dict:
    """The router's stats once neither instance holds a block or an export."""

    def idle():
        stats = client.get(f"{url}/v1/engine/stats").json()
        held = stats["used_blocks"], stats["prefill"]["used_blocks"], stats["prefill"]["exports_live"]
        return stats if held == (0, 0, 0) else None

    return wait_for(idle, what="nothing held")


def assert_all_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    def gone():
        return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    wait_for(gone, timeout_s, what="every process of the deployment gone")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_models):
    """The module's deployment, with the engine fault hook in its prefill instance (unarmed)."""
    folder = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("supervised")
    (tmp / "hook").mkdir()
    (tmp / "hook" / "sitecustomize.py").write_text(ENGINE_FAULT_HOOK)
    path = os.pathsep.join([str(tmp / "hook"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "DCPCTL_TEST_ENGINE_FAULT": str(tmp / "armed")}
    run = start(tmp, folder, env=env)
    yield run, folder, tmp / "armed"
    run.stop()


def restarts(client: httpx.Client, url: str) -> dict:
    return client.get(f"{url}/v1/engine/stats").json()["router"]["restarts"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_killed_instance_is_reported_restarted_and_serves_again(served, role):
    run, folder, _ = served
    url = run.base_url
    ids = prompt_ids(1, [21], seed=3)[0]
    expected = hf_greedy(folder, ids, NEW_TOKENS)[0]
    with httpx.Client(timeout=120, trust_env=False) as client:
        assert tokens(client, url, ids) == expected
        before = restarts(client, url)
        victim = piece(run, role)
        instance_url = re.search(rf"{role} (http://\S+?)[,;]", terminal(run)).group(1)
        broken = None
        if role == "decode":  # a stream in flight when the decode instance dies ends with an error event
            stream = client.stream("POST", f"{url}/v1/completions", json=body(ids, max_tokens=400, stream=True))
            response = stream.__enter__()
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
        killed = time.monotonic()
        kill_tree(victim)
        if role == "decode":
            broken = [line for line in lines if line.startswith("data: ")]
            stream.__exit__(None, None, None)
        line = wait_for(
            lambda: re.search(rf"\d\d:\d\d:\d\d the {role} instance .*was killed by SIGKILL; log: \S+", terminal(run)),
            timeout_s=10,
            what="the report on the terminal",
        ).group(0)
        detected = time.monotonic() - killed
        assert f"the {role} instance {instance_url} (pid {victim.pid}) was killed by SIGKILL" in line
        assert line.endswith(f"log: {logs_dir(run) / f'{role}.log'}"), line
        # the supervisor says so after it has stopped the rest of the instance's process tree (seconds under load)
        restarting = f"restarting the {role} instance {instance_url} in 1 s (restart 1 of at most 3"
        wait_for(lambda: restarting in terminal(run), timeout_s=30, what="the restart report")
        # while it is down: 503 with Retry-After, naming it, from /health and for a request
        down = wait_for(lambda: (r := client.get(f"{url}/health")).status_code == 503 and r, what="router 503")
        assert f"the {role} instance {instance_url} is unhealthy" in down.text
        assert int(down.headers["retry-after"]) >= 1
        refused = client.post(f"{url}/v1/completions", json=body(ids))
        if refused.status_code == 503:  # unless the restart was quicker than this request
            assert int(refused.headers["retry-after"]) >= 1 and f"the {role} instance" in refused.text
        wait_for(lambda: client.get(f"{url}/health").status_code == 200, timeout_s=120, what="router healthy")
        healthy = time.monotonic() - killed
        assert tokens(client, url, ids) == expected
        stats = settled(client, url)
        assert stats["router"]["restarts"] == {**before, role: before[role] + 1}
        assert stats["router"]["healthy"] == {"prefill": True, "decode": True}
        assert re.search(
            rf"the {role} instance {instance_url} \(pid \d+\) is healthy again: [\d.]+ s after", terminal(run)
        )
        assert f"{role}.restart-1.log" in terminal(run)
    if broken is not None:
        assert broken[-1] == "data: [DONE]", broken[-3:]
        error = json.loads(broken[-2].removeprefix("data: "))["error"]
        assert f"the decode instance {instance_url} broke off the stream" in error["message"], error
        router_log = (logs_dir(run) / "router.log").read_text()
        assert f"a stream from the decode instance {instance_url} broke off" in router_log
    print(f"\n{role}: killed -> reported {detected:.2f} s, -> router healthy {healthy:.1f} s")


def test_an_instance_whose_engine_failed_is_restarted(served):
    """The prefill instance's engine fails (its process lives on, its /health says so): the request fails naming
    the cause, the supervisor reports the instance unusable and restarts it, and it serves HF's tokens again."""
    run, folder, armed = served
    url = run.base_url
    ids = prompt_ids(1, [9], seed=4)[0]
    with httpx.Client(timeout=120, trust_env=False) as client:
        wait_for(lambda: client.get(f"{url}/health").status_code == 200, timeout_s=120, what="router healthy")
        before = restarts(client, url)
        victim = piece(run, "prefill")
        up = r"the prefill instance \S+ \(pid \d+\) is healthy again"
        ups_before = len(re.findall(up, terminal(run)))
        armed.touch()
        failed = client.post(f"{url}/v1/completions", json=body(ids))
        assert failed.status_code == 502 and "injected engine fault" in failed.text, failed.text
        line = wait_for(
            lambda: re.search(
                r"the prefill instance \S+ \(pid (\d+)\) is alive but unusable: (.*); log", terminal(run)
            ),
            what="the report",
        )
        assert int(
            line.group(1)
        ) == victim.pid and "the engine failed (RuntimeError: injected engine fault)" in line.group(2)
        # the router's health is polled (about once a second): wait for the supervisor's word that the new instance
        # is up first, or a stale "healthy" from before the restart lets the request meet the stopped one
        wait_for(lambda: len(re.findall(up, terminal(run))) > ups_before, timeout_s=120, what="the restart")
        wait_for(lambda: client.get(f"{url}/health").status_code == 200, timeout_s=120, what="router healthy")
        assert tokens(client, url, ids) == hf_greedy(folder, ids, NEW_TOKENS)[0]
        assert settled(client, url)["router"]["restarts"] == {**before, "prefill": before["prefill"] + 1}
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE


def test_a_dead_router_ends_the_run(served):
    """The last test of the module: the run ends (exit 1), saying why, and stops both instances."""
    run, _, _ = served
    pids = [p.pid for p in run.processes()]
    router = piece(run, "router")
    router.send_signal(signal.SIGKILL)
    assert run.proc.wait(timeout=60) == 1
    message = terminal(run)
    assert re.search(
        r"error: the router http://\S+ \(pid \d+\) was killed by SIGKILL \(log: \S+router.log\); the "
        r"deployment stops with it",
        message,
    ), message[-2000:]
    assert_all_gone(pids)


def test_restarts_used_up_end_the_run(tmp_path, tiny_models):
    """disagg.max_restarts=1: the prefill instance killed once is restarted; its model folder gone, the restart fails,
    and that second death ends the run (exit 1) naming the instance, the cause and the log; nothing is left."""
    folder = Path(shutil.copytree(tiny_models("llama"), tmp_path / "model"))
    run = start(tmp_path, folder, {"max_restarts": 1})
    try:
        pids = [p.pid for p in run.processes()]
        shutil.rmtree(folder)
        kill_tree(piece(run, "prefill"))
        assert run.proc.wait(timeout=120) == 1
        message = terminal(run)
        assert "restarting the prefill instance" in message and "(restart 1 of at most 1 within 10 minutes)" in message
        assert re.search(
            r"error: the prefill instance http://\S+ died 2 times within 10 minutes, the last time exited with code 1: "
            r"error: .*model.*\(log: \S+prefill.restart-1.log\); its disagg.max_restarts=1 restarts are used up",
            message,
        ), message[-2000:]
        assert_all_gone(pids)
    finally:
        run.stop()


def test_max_restarts_0_fails_fast(tmp_path, tiny_models):
    """disagg.max_restarts=0: the decode instance killed ends the run at once (exit 1), nothing is restarted and
    nothing is left."""
    run = start(tmp_path, tiny_models("llama"), {"max_restarts": 0})
    try:
        pids = [p.pid for p in run.processes()]
        kill_tree(piece(run, "decode"))
        killed = time.monotonic()
        assert run.proc.wait(timeout=60) == 1
        assert time.monotonic() - killed < 30
        message = terminal(run)
        assert re.search(
            r"error: the decode instance http://\S+ was killed by SIGKILL \(log: \S+decode.log\); "
            r"disagg.max_restarts=0, so the deployment stops",
            message,
        ), message[-2000:]
        assert "restarting" not in message
        assert_all_gone(pids)
    finally:
        run.stop()


def test_a_supervisor_killed_outright_leaves_nothing_running(tmp_path, tiny_models):
    """SIGKILL to `dcpctl run` itself (the OOM killer's way): its prefill, decode and router processes notice and
    stop on their own."""
    run = start(tmp_path, tiny_models("llama"))
    try:
        pids = [p.pid for p in run.processes()]
        assert len(pids) >= 4  # prefill, decode (torchrun and its two ranks), router
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait(timeout=10)
        assert_all_gone(pids, timeout_s=60)
    finally:
        run.stop()
