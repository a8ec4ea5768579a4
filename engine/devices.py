"""What devices this machine has, found without importing torch (plan checks stay fast)."""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path


def cuda_device_count() -> int:
    """Visible NVIDIA GPUs: the driver's /proc entries, filtered by CUDA_VISIBLE_DEVICES."""
    gpus = Path("/proc/driver/nvidia/gpus")
    present = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    return min(present, len(ids))


@functools.cache
def cpu_set() -> tuple[int, ...]:
    """The CPUs this process may run on, as first asked: `import engine` asks before torch loads, because OpenMP
    binding (GOMP_CPU_AFFINITY, OMP_PROC_BIND, the engine's own pinning) then pins the main thread to the first core,
    and its affinity alone would say 1 (the engine then ran one thread on a 2-core machine). Where torch was imported
    first and GOMP_CPU_AFFINITY has pinned this thread to the first CPU it lists, the list is the set."""
    try:
        allowed = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))
    listed = gomp_affinity_cpus(os.environ.get("GOMP_CPU_AFFINITY", ""))
    if "torch" in sys.modules and len(allowed) == 1 and listed and listed[0] == allowed[0]:
        return tuple(cpu for cpu in listed if cpu < (os.cpu_count() or 1)) or allowed
    return allowed


def gomp_affinity_cpus(value: str) -> tuple[int, ...]:
    """The CPUs a GOMP_CPU_AFFINITY value lists, in its order without repeats: numbers, ranges `M-N` and strided
    ranges `M-N:S`, separated by spaces or commas (libgomp's syntax). Empty for an empty or unreadable value."""
    cpus: dict[int, None] = {}
    for item in filter(None, re.split(r"[\s,]+", value.strip())):
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", item)
        if match is None:
            return ()
        first, last, stride = int(match[1]), int(match[2] or match[1]), int(match[3] or 1)
        cpus.update(dict.fromkeys(range(first, last + 1, max(stride, 1))))
    return tuple(cpus)


def cpu_cores() -> int:
    """How many CPU cores this process may run on (`cpu_set`)."""
    return len(cpu_set())


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (free RAM for new allocations), 0 if unknown."""
    return _meminfo("MemAvailable")


def total_memory_bytes() -> int:
    """MemTotal from /proc/meminfo (the machine's RAM), 0 if unknown."""
    return _meminfo("MemTotal")


def _meminfo(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resolve_device(requested: str) -> str:
    """'auto' becomes 'cuda' when a GPU is visible, else 'cpu'."""
    if requested != "auto":
        return requested
    return "cuda" if cuda_device_count() > 0 else "cpu"
