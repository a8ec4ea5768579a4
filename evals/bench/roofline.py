"""Decode roofline: the measured decode step next to the time to read the weights and the KV cache once.

Memory bandwidth comes from a copy benchmark (a large tensor copy; bytes read + bytes written over the time, like
STREAM's copy). A decode step must read, on every rank, that rank's weights and the KV of every running sequence
it holds; ranks that share one memory system (all the ranks of a CPU node; a GPU has its own) share its
bandwidth, so their bytes add up. The limit is the busiest memory system's bytes over its bandwidth, and the
figure printed is limit / measured step time (1.0 = at the memory-bandwidth limit).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from engine.suggest.measure import COPY_BYTES, copy_bandwidth


def copy_bandwidth_subprocess(device: str = "cpu", timeout_s: float = 120.0) -> float:
    """`copy_bandwidth` in a fresh interpreter, so this process holds no CUDA context (nor the copy buffers) while
    the servers it launches run."""
    proc = subprocess.run(
        [sys.executable, "-m", "evals.bench.roofline", "--device", device],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {device} copy benchmark failed: {tail}")
    return float(proc.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Roofline:
    """One target's decode step against the memory-bandwidth limit."""

    weight_bytes_per_rank: float
    kv_bytes_per_rank: float  # KV read per step by one rank (its share of every running sequence)
    ranks_per_memory: int  # ranks that share one memory system's bandwidth
    bandwidth_bytes_s: float
    batch: float  # running sequences per decode step
    context_len: float  # mean tokens per sequence over the decode steps
    measured_step_s: float

    @property
    def bytes_per_step(self) -> float:
        """Bytes the busiest memory system serves per decode step."""
        return self.ranks_per_memory * (self.weight_bytes_per_rank + self.kv_bytes_per_rank)

    @property
    def limit_s(self) -> float:
        """The fastest a step can be: its bytes at the measured bandwidth."""
        return self.bytes_per_step / self.bandwidth_bytes_s

    @property
    def fraction(self) -> float:
        """limit / measured: how close the step is to the memory-bandwidth limit (1.0 = at it)."""
        return self.limit_s / self.measured_step_s

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "bytes_per_step": self.bytes_per_step,
            "limit_s": self.limit_s,
            "fraction": self.fraction,
        }


def decode_roofline(
    *,
    weight_bytes_per_rank: float,
    kv_bytes_per_token: float,
    dcp: int,
    ranks_per_memory: int,
    batch: float,
    context_len: float,
    bandwidth_bytes_s: float,
    measured_step_s: float,
) -> Roofline:
    """The roofline of a layout: the weights one rank holds (engine.placement.weights, exact for its dense
    placement), each rank's KV per token (`kv_bytes_per_token`, already for its tp shard of the heads) split over
    `dcp`."""
    return Roofline(
        weight_bytes_per_rank=weight_bytes_per_rank,
        kv_bytes_per_rank=batch * context_len * kv_bytes_per_token / dcp,
        ranks_per_memory=ranks_per_memory,
        bandwidth_bytes_s=bandwidth_bytes_s,
        batch=batch,
        context_len=context_len,
        measured_step_s=measured_step_s,
    )


def main() -> None:
    """Print the copy bandwidth of a device in bytes/s (what `copy_bandwidth_subprocess` reads)."""
    parser = argparse.ArgumentParser(description="Measured memory bandwidth (tensor copy), bytes/s.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size-mib", type=int, default=COPY_BYTES // 2**20)
    args = parser.parse_args()
    print(f"{copy_bandwidth(args.device, args.size_mib * 2**20):.6g}")


if __name__ == "__main__":
    main()
