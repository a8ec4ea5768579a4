"""The OpenMP wait policy the engine sets before torch loads (a ~100 µs spin, then sleep) unless the user chose one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "import os, engine, torch; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, ["PASSIVE", "10000"]), ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"}, ["ACTIVE", "5"])],
)
def test_import_engine_sets_the_wait_policy_unless_given(given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | given
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == expected


def test_engine_import_sets_it_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: `import engine` must not load torch first."""
    probe = "import sys, engine; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


@pytest.mark.parametrize("imports", ["engine, torch", "torch, engine"])
def test_bound_openmp_threads_still_get_every_core(imports):
    """GOMP_CPU_AFFINITY pins the main thread to one core when torch loads: the engine's thread count comes from the
    process's cores as they were at `import engine`, not from that pinned thread; and with torch imported first,
    from the cores the variable lists."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    env = dict(os.environ, GOMP_CPU_AFFINITY=",".join(map(str, cores)))
    probe = f"import os, {imports}; from engine import devices; torch.ones(2).sum(); "
    probe += "print(len(os.sched_getaffinity(0)), devices.cpu_cores())"
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    pinned, counted = map(int, result.stdout.split())
    assert (pinned, counted) == (1, len(cores))


@pytest.mark.parametrize(
    ("value", "cpus"),
    [
        ("0 1", (0, 1)),
        ("3,1 0-2", (3, 1, 0, 2)),
        ("0-7:2", (0, 2, 4, 6)),
        (" 4-5 , 9 ", (4, 5, 9)),
        ("", ()),
        ("0 x", ()),
        ("1-", ()),
    ],
)
def test_gomp_cpu_affinity_lists_read_as_libgomp_reads_them(value, cpus):
    from engine.devices import gomp_affinity_cpus

    assert gomp_affinity_cpus(value) == cpus


# ---------------------------------------------------------------- pinning each rank's threads to its cores


@pytest.fixture
def no_binding_env(monkeypatch):
    from engine.kernels.cpu_threads import BIND_ENV, USER_BINDING_ENV

    for name in (BIND_ENV, *USER_BINDING_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ranks_of_a_node_take_consecutive_runs_of_the_cpu_set(no_binding_env):
    from engine.kernels.cpu_threads import rank_cores

    cpus = (2, 3, 5, 8)
    assert rank_cores(cpus, 0, 1, 4) == (2, 3, 5, 8)
    assert [rank_cores(cpus, r, 2, 2) for r in range(2)] == [(2, 3), (5, 8)]
    assert [rank_cores(cpus, r, 4, 1) for r in range(4)] == [(2,), (3,), (5,), (8,)]
    assert rank_cores(cpus, 0, 1, 2) == (2, 3)  # fewer threads than cores: the first ones


def test_no_pinning_when_oversubscribed_switched_off_or_bound_by_the_user(no_binding_env):
    from engine.kernels.cpu_threads import rank_cores

    assert rank_cores((0, 1), 0, 3, 1) is None  # 3 ranks on 2 cores: stacking threads on one core would be worse
    assert rank_cores((0, 1), 0, 1, 3) is None
    no_binding_env.setenv("DCPCTL_BIND_THREADS", "0")
    assert rank_cores((0, 1), 0, 1, 2) is None
    no_binding_env.setenv("DCPCTL_BIND_THREADS", "1")
    no_binding_env.setenv("OMP_PROC_BIND", "close")
    assert rank_cores((0, 1), 0, 1, 2) is None


def test_a_bad_bind_setting_is_a_one_line_error(no_binding_env):
    from engine.errors import UserError
    from engine.kernels.cpu_threads import rank_cores

    no_binding_env.setenv("DCPCTL_BIND_THREADS", "yes")
    with pytest.raises(UserError) as err:
        rank_cores((0, 1), 0, 1, 2)
    assert str(err.value) == (
        "DCPCTL_BIND_THREADS='yes': use 1 (pin each rank's threads to cores) or 0 (leave them unpinned)"
    )


PIN_PROBE = """
import json, os, sys, engine, torch
from engine import LLM, SamplingParams
before = sorted(os.sched_getaffinity(0))
with LLM(sys.argv[1]) as llm:
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    tasks = sorted(sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task"))
    cores = llm.engine.runner.thread_cores
print(json.dumps({"cores": cores, "threads": torch.get_num_threads(), "tasks": tasks,
                  "restored": sorted(os.sched_getaffinity(0)) == before}))
"""


@pytest.mark.parametrize("bind", ["1", "0"])
def test_the_stepping_threads_are_pinned_one_to_a_core_and_the_caller_gets_its_cores_back(tmp_path, tiny_models, bind):
    """With pinning (the default) the thread that steps and its OpenMP worker each hold one core of the CPU set while
    the engine runs, and the calling thread has its whole CPU set back after `close()` (its children get all cores);
    with DCPCTL_BIND_THREADS=0 no thread is pinned."""
    from engine.kernels.cpu_kernels import cpu_kernels_available
    from tests.oracle import write_plan

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or not cpu_kernels_available():
        pytest.skip("needs two cores and the engine's CPU kernels")
    plan = write_plan(tmp_path, tiny_models("llama"), {"attention.backend": "cpu", "launch.threads_per_rank": 2})
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")}
    env["DCPCTL_BIND_THREADS"] = bind
    result = subprocess.run(
        [sys.executable, "-c", PIN_PROBE, str(plan)], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])  # tasks: the CPU set of every thread of the process
    assert seen["threads"] == 2 and seen["restored"]
    if bind == "1":
        assert seen["cores"] == cores[:2]
        assert [cores[0]] in seen["tasks"] and [cores[1]] in seen["tasks"]
    else:
        assert seen["cores"] is None
        assert all(t == cores for t in seen["tasks"])


TWO_ENGINES_PROBE = """
import json, os, sys, engine
from engine import LLM, SamplingParams
before = sorted(os.sched_getaffinity(0))
params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
first, second = LLM(sys.argv[1]), LLM(sys.argv[1])
second.generate([[5, 6, 7]], params)  # `second` pins this thread first, then `first` finds it pinned
first.generate([[5, 6, 7]], params)
pinned = sorted(os.sched_getaffinity(0))
second.close()
after_one = sorted(os.sched_getaffinity(0))
first.close()
restored = sorted(os.sched_getaffinity(0))
print(json.dumps({"pinned": pinned != before, "after_one": after_one == before, "restored": restored == before}))
"""


def test_two_engines_stepped_from_one_thread_give_it_back_whichever_closes_first(tmp_path, tiny_models):
    """Two LLMs in one script pin the same thread: the second must not take the first's pinning for the thread's
    own CPU set, or closing them leaves the script (and every process it starts) on one core."""
    from engine.kernels.cpu_kernels import cpu_kernels_available
    from tests.oracle import write_plan

    if len(os.sched_getaffinity(0)) < 2 or not cpu_kernels_available():
        pytest.skip("needs two cores and the engine's CPU kernels")
    plan = write_plan(tmp_path, tiny_models("llama"), {"attention.backend": "cpu", "launch.threads_per_rank": 2})
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")}
    env["DCPCTL_BIND_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", TWO_ENGINES_PROBE, str(plan)], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"pinned": True, "after_one": False, "restored": True}


HAND_OVER_PROBE = """
import json, os, sys, time, engine, torch
from engine.core.engine import LLMEngine
from engine.core.startup import start_rank
from engine.plan.checks import resolve_plan
from engine.serving.engine_loop import EngineLoop
config, par, runner = start_rank(resolve_plan(sys.argv[1]))
x = torch.randn(1 << 22)
(x * 2).sum()  # this thread forks a team of its own, as loading a real checkpoint does
tasks = lambda: set(os.listdir("/proc/self/task"))
before = tasks()
engine_loop = EngineLoop(LLMEngine(config, par, runner)).start()
deadline = time.monotonic() + 10
while len(before - tasks()) < torch.get_num_threads() - 1 and time.monotonic() < deadline:
    time.sleep(0.05)
after = tasks()
engine_loop.stop()
print(json.dumps({"gone": len(before - after), "new": len(after - before), "threads": torch.get_num_threads()}))
"""


def test_the_thread_that_hands_the_engine_to_a_server_thread_gives_up_its_openmp_workers(tmp_path, tiny_models):
    """A served engine starts on one thread and steps on another: the starting thread's OpenMP workers exit when it
    hands the engine over. Two teams would be more OpenMP threads than cores, and libgomp then sleeps at every barrier
    instead of spinning (served batch-16 decode steps of SmolLM2 ~15% slower, docs/results/cpu-kernels.md)."""
    from engine.kernels.cpu_kernels import cpu_kernels_available
    from tests.oracle import write_plan

    if not cpu_kernels_available():
        pytest.skip("needs the engine's CPU kernels")
    plan = write_plan(tmp_path, tiny_models("llama"), {"attention.backend": "cpu", "launch.threads_per_rank": 2})
    result = subprocess.run(
        [sys.executable, "-c", HAND_OVER_PROBE, str(plan)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"gone": 1, "new": 1, "threads": 2}  # its one worker gone; the engine thread (idle: no team yet)
