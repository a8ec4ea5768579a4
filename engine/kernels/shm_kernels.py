"""The shared-memory collective kernels (csrc/shm_comm.cpp): built per ISA level like the CPU kernels, loaded once.

A library of its own (ops under `torch.ops.dcpctl_shm`), so that the collectives do not depend on the compute
kernels' opt-out (`DCPCTL_CPU_KERNELS=0`). `engine.shm_comm` owns the segments and calls these ops.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from engine.kernels.cpu_isa import detect
from engine.kernels.cpu_kernels import build_for_cpu

SOURCES = (Path(__file__).with_name("csrc") / "shm_comm.cpp",)
LIBRARY = "dcpctl_shm_comm"
_log = logging.getLogger(__name__)


@functools.cache
def build_problem() -> str | None:
    """Build (first time) and load the collective kernels (for the highest level the compiler builds): None when
    loaded, else why not, in one line."""
    isa, outcome = build_for_cpu(SOURCES, LIBRARY)
    return None if isa else outcome


if __name__ == "__main__":  # scripts/setup.sh: build now rather than at the first shared-memory run
    print(f"dcpctl shared-memory collectives ({detect().describe()}):", build_problem() or "built")
