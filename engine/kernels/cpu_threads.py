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
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"
SPIN_COUNT = "10000"


def default_wait_policy() -> None:
    """Export OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=10000 into this process (and so its ranks) unless set."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
