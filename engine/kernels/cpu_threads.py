"""How the engine's OpenMP threads wait between parallel regions: asleep (`OMP_WAIT_POLICY=PASSIVE`) by default.

A decode step runs ~150 parallel regions (one per linear layer, the attention, a few torch ops), and each ends in
a barrier of all threads. With OpenMP's default, a thread that reaches a barrier first spins; when another
process holds one of the cores (a shared machine, a server with other work), the spinning thread takes the very
time slice the thread still working needs, and every barrier then costs milliseconds. Sleeping at the barrier
costs microseconds on idle cores and removes that stall: measured on the 2-core machine shared with other jobs
(load ~10), SmolLM2's 30 layers of fp32 linears at 16 rows took 70 ms instead of 590 ms, and a batch-16 decode
step 0.2 s instead of ~2 s (benchmarks/RESULTS.md). libgomp reads the variable once, when torch loads it, so
`engine/__init__.py` sets it at import; a value the user set wins. No torch import here.
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"


def default_wait_policy() -> None:
    """Export OMP_WAIT_POLICY=PASSIVE into this process (and so its ranks) unless it is already set."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
