"""Measuring this machine's CPU for planning (the `cpu` device) and for the bench roofline.

- memory bandwidth: a large tensor copy (bytes read + written over the best time, like STREAM's copy);
- matmul throughput per core: fp32 `F.linear` at a decode-sized batch on one thread;
- collective latency: a small all-gather between two local processes, through gloo (what ranks on different nodes
  use) and through the engine's shared-memory collectives (`engine.shm_comm`, what ranks of one node use).

`cpu_figures` measures once in a fresh interpreter (so the caller holds no torch state) and caches the result per
machine (CPU model, cores, torch version) in `figures_file()`; `--remeasure` ignores the cache.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine import devices
from engine.errors import UserError
from engine.io_utils import atomic_write_text

COPY_BYTES = 256 * 2**20  # well beyond the last-level cache of the CPUs and GPUs this runs on
MATMUL_SHAPE = (8, 2048, 2048)  # rows (decode batch), in, out
COLLECTIVE_ITERS = 200


def copy_bandwidth(device: str = "cpu", size_bytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Measured memory bandwidth in bytes/s: 2 * size / (best time of a `size_bytes` tensor copy)."""
    import torch

    n = size_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dst.copy_(src)  # first touch: page faults / allocation are not bandwidth
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


def matmul_flops_per_core(repeats: int = 20) -> float:
    """fp32 FLOP/s of one thread on a decode-sized `F.linear` (best of `repeats`)."""
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows, k, n = MATMUL_SHAPE
        x, w = torch.randn(rows, k), torch.randn(n, k)
        F.linear(x, w)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            F.linear(x, w)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * rows * k * n / best


def _seconds_per_call(call) -> float:
    import torch.distributed as dist

    for _ in range(10):
        call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(COLLECTIVE_ITERS):
        call()
    return (time.perf_counter() - start) / COLLECTIVE_ITERS


def _collective_worker(rank: int, store_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from engine import shm_comm
    from engine.group_comm import GroupComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", 2), rank=rank, world_size=2)
    part = torch.zeros(1, 256)
    latency = {"gloo": _seconds_per_call(lambda: GroupComm(dist.group.WORLD).all_gather_rows(part))}
    shm = shm_comm.attach(dist.group.WORLD, 60.0)
    latency["shm"] = None if isinstance(shm, str) else _seconds_per_call(lambda: shm.all_gather_rows(part))
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(latency))
    dist.destroy_process_group()


def collective_latency() -> dict[str, float | None]:
    """Seconds per small all-gather between two processes of this machine: {"gloo": s, "shm": s or None when
    the shared-memory collectives cannot run here}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/latency"
        mp.start_processes(_collective_worker, args=(tmp, out), nprocs=2, start_method="spawn", join=True)
        return json.loads(Path(out).read_text())


def figures_file() -> Path:
    """Where the measured CPU figures are cached: `$DCPCTL_CPU_FIGURES`, else ~/.cache/dcpctl/cpu-figures.json."""
    env = os.environ.get("DCPCTL_CPU_FIGURES")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dcpctl" / "cpu-figures.json"


def machine_key() -> dict[str, str | int]:
    """What the cached figures belong to: a different CPU, core count or torch measures again."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version

    return {"cpu": model, "cores": devices.cpu_cores(), "torch": version("torch")}


FIGURES = ("bandwidth", "flops32_per_core", "collective_latency_s", "shm_collective_latency_s")


def cpu_figures(remeasure: bool = False, timeout_s: float = 300.0) -> dict[str, float | None]:
    """{bandwidth, flops32_per_core, collective_latency_s (gloo), shm_collective_latency_s (None: no shared-memory
    collectives here)} of this machine, from the cache or measured now."""
    path, key = figures_file(), machine_key()
    if not remeasure:
        try:
            cached = json.loads(path.read_text())
            if cached.get("machine") == key and set(FIGURES) <= set(cached["figures"]):
                return cached["figures"]
        except (OSError, ValueError, AttributeError, KeyError):
            pass
    proc = subprocess.run(
        [sys.executable, "-m", "engine.suggest.measure"], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"measuring this CPU failed: {tail}; give --bandwidth/--flops figures instead")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"machine": key, "figures": figures, "measured_at": time.time()}))
    except OSError:
        pass  # an unwritable cache only costs a measurement next time
    return figures


def main() -> None:
    """Print this machine's CPU figures as JSON (what `cpu_figures` reads)."""
    latency = collective_latency()
    figures = {
        "bandwidth": copy_bandwidth(),
        "flops32_per_core": matmul_flops_per_core(),
        "collective_latency_s": latency["gloo"],
        "shm_collective_latency_s": latency["shm"],
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
