"""Latency of one collective between two CPU ranks: gloo vs the shared-memory backend (engine.shm_comm).

Sizes are SmolLM2's (hidden 576, 9 heads of 64, vocab 49152) at tp1/dcp2: decode batch 1 and 8, and one prefill
chunk of 2048 tokens. Both ranks run one thread, as the engine gives each of two local ranks on 2 cores.
The variants run interleaved, `--calls` back-to-back calls per sample, `--reps` samples each; the table gives the
best and the median microseconds per call and gloo's time over shm's. `torch-shm` is the same protocol written with
torch ops and a Python wait loop on the same segment (all-reduce only): the measurement behind doing it in C++.

    .venv/bin/python benchmarks/collectives.py [--reps 30] [--calls 50]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import shm_comm
from engine.group_comm import GroupComm
from engine.kernels.cpu_isa import detect
from engine.runtime.launcher import free_port

HIDDEN, HEADS, HEAD_DIM, VOCAB = 576, 9, 64, 49152
A2A_ROW = HEADS * HEAD_DIM + HEADS  # replicated a2a combine: the partial output and the LSE bits per token


def cases() -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    """(name, collective, per-rank input shape, dtype)."""
    rows = []
    for batch in (1, 8):
        rows += [
            (f"all_reduce [{batch}, {HIDDEN}] fp32", "all_reduce", (batch, HIDDEN), torch.float32),
            (f"all_reduce [{batch}, {HIDDEN}] bf16", "all_reduce", (batch, HIDDEN), torch.bfloat16),
            (f"all_gather lse [1, {batch}, {HEADS}]", "all_gather", (1, batch, HEADS), torch.float32),
            (f"all_to_all [2, {batch}, {A2A_ROW}]", "all_to_all", (2, batch, A2A_ROW), torch.float32),
            (f"reduce_scatter [2, {batch}, {HIDDEN // 2}]", "reduce_scatter", (2, batch, HIDDEN // 2), torch.float32),
            (f"gather logits [{batch}, {VOCAB // 2}]", "gather", (batch, VOCAB // 2), torch.float32),
        ]
    rows.append((f"all_reduce [2048, {HIDDEN}] fp32 (prefill)", "all_reduce", (2048, HIDDEN), torch.float32))
    return rows


def run_one(kind: str, comm: GroupComm, x: torch.Tensor) -> None:
    """One collective of `kind` on x through `comm` (gloo: GroupComm; shared memory: its ShmGroup)."""
    if kind == "all_reduce":
        comm.all_reduce(x)
    elif kind == "all_gather":
        comm.all_gather_rows(x)
    elif kind == "all_to_all":
        comm.all_to_all_rows(x)
    elif kind == "reduce_scatter":
        comm.reduce_scatter_rows(x)
    else:
        comm.gather_to_first(x)


class TorchShmAllReduce:
    """The shared-memory all-reduce of two ranks in torch ops and Python (a second segment, same protocol)."""

    def __init__(self, rank: int, path: str, numel: int):
        self.rank, self.peer, self.round = rank, 1 - rank, 0
        nbytes = 128 + 2 * 2 * numel * 4
        segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.seq = segment[:128].view(torch.int64)  # rank r's count at index 8 * r (its own cache line)
        self.buffers = segment[128:].view(torch.float32).view(2, 2, numel)  # [rank, parity, numel]

    def __call__(self, x: torch.Tensor) -> None:
        self.round += 1
        flat, n = x.view(-1), x.numel()
        self._wait(self.round - 1)
        self.buffers[self.rank, self.round & 1, :n].copy_(flat)
        self.seq[8 * self.rank] = self.round
        self._wait(self.round)
        torch.add(self.buffers[0, self.round & 1, :n], self.buffers[1, self.round & 1, :n], out=flat)

    def _wait(self, round_: int) -> None:
        flag = self.seq[8 * self.peer]
        while int(flag) < round_:
            os.sched_yield()


def _rank(rank: int, port: int, reps: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    gloo = GroupComm(group)
    shm = shm_comm.attach(group, 60.0)
    assert not isinstance(shm, str), shm
    path = shm_comm.SHM_DIR / f"dcpctl-bench-{port}"
    if rank == 0:
        path.write_bytes(b"\0" * (128 + 16 * 2048 * HIDDEN))
    dist.barrier()
    torch_shm = TorchShmAllReduce(rank, str(path), 2048 * HIDDEN)
    dist.barrier()
    if rank == 0:
        path.unlink()
    results = {}
    for name, kind, shape, dtype in cases():
        x = torch.randn(shape).to(dtype)
        variants = {
            "gloo": functools.partial(run_one, kind, gloo, x),
            "shm": functools.partial(run_one, kind, shm, x),
        }
        if kind == "all_reduce" and dtype == torch.float32:
            variants["torch-shm"] = functools.partial(torch_shm, x)
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for rep in range(reps + 2):  # two warm-up samples
            for variant, call in variants.items():
                dist.barrier(group)
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                if rep >= 2:
                    samples[variant].append((time.perf_counter() - start) / calls * 1e6)
        results[name] = samples
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(free_port(), args.reps, args.calls, out), nprocs=2, start_method="spawn")
        results = json.loads(Path(out, "results.json").read_text())
    print(
        f"CPU ISA {detect().describe()}; 2 ranks x 1 thread; load average before {load[0]:.1f}, after "
        f"{os.getloadavg()[0]:.1f}; {args.reps} samples x {args.calls} calls, interleaved"
    )
    print(
        "| collective | gloo best / median µs | shm best / median µs | gloo/shm (best) | torch-shm best / median µs |"
    )
    print("|---|---|---|---|---|")
    for name, samples in results.items():
        cells = {v: (min(s), statistics.median(s)) for v, s in samples.items()}
        torch_cell = "{:.1f} / {:.1f}".format(*cells["torch-shm"]) if "torch-shm" in cells else ""
        gloo, shm = cells["gloo"], cells["shm"]
        ratio = gloo[0] / shm[0]
        print(f"| {name} | {gloo[0]:.1f} / {gloo[1]:.1f} | {shm[0]:.1f} / {shm[1]:.1f} | {ratio:.1f}x | {torch_cell} |")


if __name__ == "__main__":
    main()
