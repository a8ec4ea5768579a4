"""Measuring this machine's CPU for planning (the `cpu` device) and for the bench roofline.

- memory bandwidth: a large tensor copy (bytes read + written over the best time, like STREAM's copy);
- gloo's collective latency (what ranks on different nodes use): a small all-gather between two local processes,
  each call after a layer's worth of work on every rank, as in a decode step;
- per model (its decode shapes, `engine.suggest.decode_timing`): the engine's linear layers' FLOP/s and its decode
  attention's KV bytes/s (per core with every core busy, and of one rank on all cores), its host time per layer of
  a decode step (one-rank and DCP layouts), and the latency of a collective between the ranks of one node inside a real
  two-rank decode step (what the shared-memory collectives cost there).

`cpu_figures` measures once in a fresh interpreter (so the caller holds no torch state) and caches the result per
machine (CPU model, cores, torch version) in `figures_file()`, the per-model figures under their shapes (a model
not measured before costs a few seconds); `--remeasure` ignores the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine import devices
from engine.errors import UserError
from engine.io_utils import atomic_write_text
from engine.suggest.decode_shapes import DecodeShapes
from engine.suggest.decode_timing import decode_figures

COPY_BYTES = 256 * 2**20  # well beyond the last-level cache of the CPUs and GPUs this runs on
COLLECTIVE_ITERS = 200
# work between two collectives of the latency loop, about a decode layer's on CPU, each rank's varying by up to
# +-WORK_JITTER: ranks that come from work reach a collective apart by more than its spin-wait covers (the waiter
# sleeps and is woken), unlike calls back to back, which measure only the spin-wait's few microseconds
LAYER_WORK_S = 200e-6
WORK_JITTER = 0.1


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


def _busy(seconds: float) -> None:
    """Keep this core busy for `seconds` (as a layer's work does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _seconds_per_call(call, rank: int) -> float:
    """Seconds `call` adds to each iteration of a loop that works about `LAYER_WORK_S` between calls on every rank
    (each rank's work varying by up to `WORK_JITTER` of it, as two ranks' layers do: the slower one is waited for)."""
    import torch.distributed as dist

    draw = random.Random(rank)
    works = [LAYER_WORK_S * draw.uniform(1 - WORK_JITTER, 1 + WORK_JITTER) for _ in range(COLLECTIVE_ITERS)]
    for _ in range(10):
        call()
    dist.barrier()
    start = time.perf_counter()
    for work in works:
        _busy(work)
        call()
    return (time.perf_counter() - start) / COLLECTIVE_ITERS - LAYER_WORK_S


def _collective_worker(rank: int, store_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from engine.group_comm import GroupComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", 2), rank=rank, world_size=2)
    part = torch.zeros(1, 256)
    latency = _seconds_per_call(lambda: GroupComm(dist.group.WORLD).all_gather_rows(part), rank)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(latency))
    dist.destroy_process_group()


def collective_latency() -> float:
    """Seconds per small all-gather through gloo between two processes of this machine."""
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


FIGURES = ("bandwidth", "collective_latency_s")
# 2: collective latency with work between calls, per-model decode figures; 3: the latency inside a node from a real
# two-rank step (step_collective_s) in place of a synthetic loop's; 4: per-core figures timed on every core at once,
# medians instead of best passes, the two-rank step's median of runs, the server's work per token (serve_token_s)
CACHE_VERSION = 4
DECODE_FIGURES = (
    "linear_flops_per_core",
    "attention_bytes_per_core",
    "linear_flops_one_rank",
    "attention_bytes_one_rank",
    "layer_host_s",
    "dcp_layer_host_s",
    "step_collective_s",
    "serve_token_s",
)


def _cached(path: Path, key: dict) -> dict:
    """The cache file's entry for this machine ({} when absent, unreadable, another machine's or measured the way
    an older `CACHE_VERSION` did); a UserError when the file holds something else, which it would overwrite."""
    try:
        cached = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        cached = None
    if not (isinstance(cached, dict) and "machine" in cached):
        raise UserError(
            f"{path} is not dcpctl's CPU figures file (DCPCTL_CPU_FIGURES); point DCPCTL_CPU_FIGURES at a new "
            "file, or remove it to measure again"
        )
    same = isinstance(cached, dict) and cached.get("machine") == key and cached.get("version") == CACHE_VERSION
    return cached if same else {}


def _measure(machine: bool, shapes: DecodeShapes, timeout_s: float) -> dict:
    """Measure in a fresh interpreter: {"figures": ... (when `machine`), "decode": ...}."""
    cmd = [sys.executable, "-m", "engine.suggest.measure", "--shapes", json.dumps(shapes.to_dict())]
    proc = subprocess.run(
        cmd + (["--machine"] if machine else []), capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"measuring this CPU failed: {tail}; give --bandwidth/--flops figures instead")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_figures(shapes: DecodeShapes, remeasure: bool = False, timeout_s: float = 300.0) -> dict[str, float]:
    """{bandwidth, collective_latency_s (gloo), and the engine's decode work at `shapes`
    (`decode_timing.decode_figures`)} of this machine, from the cache or measured now."""
    path, key = figures_file(), machine_key()
    cached = {} if remeasure else _cached(path, key)
    figures = cached.get("figures")
    decode = cached.get("decode") if isinstance(cached.get("decode"), dict) else {}
    machine = not isinstance(figures, dict) or not set(FIGURES) <= set(figures)
    measured_decode = decode.get(shapes.key)
    if machine or not isinstance(measured_decode, dict) or not set(DECODE_FIGURES) <= set(measured_decode):
        measured = _measure(machine, shapes, timeout_s)
        figures = measured["figures"] if machine else figures
        decode = {} if machine else decode  # figures of another measurement day are not mixed with today's
        measured_decode = decode[shapes.key] = measured["decode"]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            entry = {"machine": key, "version": CACHE_VERSION, "figures": figures, "decode": decode}
            text = json.dumps({**entry, "measured_at": time.time()})
            atomic_write_text(path, text)
        except OSError:
            pass  # an unwritable cache only costs a measurement next time
    return {**figures, **measured_decode}


def main() -> None:
    """Print this machine's CPU figures as JSON (what `cpu_figures` reads): --shapes JSON (a `DecodeShapes`) for
    the engine's decode work at a model's shapes, --machine for the machine's own figures as well."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--machine", action="store_true")
    args = parser.parse_args()
    out: dict = {"decode": decode_figures(DecodeShapes.from_dict(json.loads(args.shapes)))}
    if args.machine:
        out["figures"] = {"bandwidth": copy_bandwidth(), "collective_latency_s": collective_latency()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
