"""How the engine's OpenMP threads wait between parallel regions: spin ~100 µs, then sleep.

A decode step runs ~150 parallel regions (one per linear layer, the attention, a few torch ops), and each ends in
a barrier of all threads. With OpenMP's default, a thread that reaches a barrier first spins for milliseconds; when
another process holds one of the cores (a shared machine, a server with other work), the spinning thread takes the
very time slice the thread still working needs, and every barrier then costs milliseconds: measured on the 2-core
machine shared with other jobs (load ~10), a batch-16 decode step took ~2 s with the default and 0.2 s sleeping at
once (`OMP_WAIT_POLICY=PASSIVE`). Sleeping at once costs a futex wake-up at each of the ~150 regions on idle cores;
a short spin first (`GOMP_SPINCOUNT=10000`, ~100 µs by libgomp's reckoning) catches the next region of the same
step and bounds what a spin can take from another process. Measured (benchmarks/wait_policy.py,
docs/results/cpu-kernels.md): a
batch-16 fp32 step took ~47 ms with it against 71 ms with PASSIVE alone on idle cores, and ~104 against 144-183 ms
with two busy loops on the cores. libgomp reads both variables once, when torch loads it, so `engine/__init__.py`
sets them at import; values the user set win (GOMP_SPINCOUNT, where set, replaces the count OMP_WAIT_POLICY
implies). No torch import here.

The spin holds only while the process has no more OpenMP threads than cores: past that, libgomp "throttles" and
every barrier sleeps at once whatever GOMP_SPINCOUNT says. Each thread that runs a parallel region keeps a team of
its own, so a server whose engine loads on the main thread and steps on its engine thread had two teams (3 threads
on 2 cores): its decode steps slept ~2,000 times a second and ran ~25% longer than the same steps offline. The thread
that hands an engine to another frees its team first (`LLMEngine.hand_over_thread`).

Where each thread runs is the other half (`rank_cores`): a rank's OpenMP threads are pinned one to a core, as
vLLM-CPU pins its own (VLLM_CPU_OMP_THREADS_BIND). Unpinned, the threads of a 2-thread team wander: when another
process takes a core, both may share the other one, and every barrier then waits a time slice.
"""

from __future__ import annotations

import os

from engine.errors import UserError

WAIT_POLICY = "PASSIVE"
SPIN_COUNT = "10000"


def default_wait_policy() -> None:
    """Export OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=10000 into this process (and so its ranks) unless set."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


BIND_ENV = "DCPCTL_BIND_THREADS"
USER_BINDING_ENV = ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")  # the user's own OpenMP binding wins


def rank_cores(
    cpu_set: tuple[int, ...], local_rank: int, local_world_size: int, threads: int
) -> tuple[int, ...] | None:
    """The cores the `threads` OpenMP threads of a rank are pinned to, one each: the ranks of a node take consecutive
    runs of the process's CPU set. None (left to the OS) with DCPCTL_BIND_THREADS=0, with a binding the user set
    (GOMP_CPU_AFFINITY, OMP_PROC_BIND, OMP_PLACES) or when the node's ranks have more threads than cores."""
    setting = os.environ.get(BIND_ENV, "1")
    if setting not in ("0", "1"):
        raise UserError(f"{BIND_ENV}={setting!r}: use 1 (pin each rank's threads to cores) or 0 (leave them unpinned)")
    if setting == "0" or any(os.environ.get(name) for name in USER_BINDING_ENV):
        return None
    if threads < 1 or threads * local_world_size > len(cpu_set):
        return None
    first = local_rank * threads
    return cpu_set[first : first + threads]
