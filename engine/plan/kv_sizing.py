"""How many KV blocks and tokens a per-rank byte budget buys (shared by plan checks and the engine)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engine.checkpoints.model_info import ModelInfo
from engine.errors import UserError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str) -> tuple[int | None, float | None]:
    """'2GiB' -> (bytes, None); '0.5' -> (None, fraction of free device memory)."""
    match = _MEMORY.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise UserError(f"cache.memory={text!r} is not a size like '2GiB', '512MiB' or a fraction like 0.5")
    value = float(match.group(1))
    if not math.isfinite(value):
        raise UserError(f"cache.memory={text!r} is not a finite size")
    if not unit and value <= 1.0:
        if value <= 0:
            raise UserError(f"cache.memory={text!r} must be positive")
        return None, value
    if not unit and not value.is_integer():
        raise UserError(
            f"cache.memory={text!r} is neither a fraction of free memory (at most 1) nor a whole number of bytes; "
            f"write a size with a unit such as '{text}GiB', or a fraction such as 0.5"
        )
    return int(value * _UNITS[unit]), None


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. '1.5 GiB'."""
    if abs(n) >= 1024**5:  # whole TiB in integer math: a huge int (a plan's typo) overflows a float division
        return f"{int(n // 1024**4)} TiB"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class KVSizing:
    """The KV cache one rank allocates: `num_blocks` blocks of `block_size` token slots."""

    bytes_per_token: int  # one rank, all layers
    block_size: int
    dcp: int
    num_blocks: int
    draft_bytes_per_block: int = 0  # rank 0 only: a draft model's KV for one virtual block (speculative_config)

    @property
    def bytes_per_rank(self) -> int:
        """The target model's KV cache on each rank."""
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def draft_bytes(self) -> int:
        """The draft model's KV cache (rank 0 only; 0 without one)."""
        return self.num_blocks * self.draft_bytes_per_block

    @property
    def bytes_on_rank0(self) -> int:
        """Rank 0's KV: the target's share and the draft's, both within the per-rank budget."""
        return self.bytes_per_rank + self.draft_bytes

    @property
    def tokens_per_rank(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def token_capacity(self) -> int:
        """Tokens of sequences the whole DCP group can hold (each rank stores 1/dcp)."""
        return self.tokens_per_rank * self.dcp


def kv_sizing(
    info: ModelInfo,
    tp: int,
    dcp: int,
    block_size: int,
    dtype_bytes: int,
    budget_bytes: int,
    draft: ModelInfo | None = None,
) -> KVSizing:
    """Blocks that fit in `budget_bytes` on one rank for this model and layout.

    `draft`: a draft model rank 0 runs unsharded beside the target (speculative_config). Its cache shares the
    target's block ids, a whole virtual block (block_size x dcp tokens) each, so every block costs rank 0 that much
    more and all ranks allocate the count rank 0 affords."""
    per_token = info.kv_bytes_per_token(tp, dtype_bytes)
    draft_per_block = draft.kv_bytes_per_token(1, dtype_bytes) * block_size * dcp if draft is not None else 0
    return KVSizing(
        bytes_per_token=per_token,
        block_size=block_size,
        dcp=dcp,
        num_blocks=max(0, budget_bytes // (per_token * block_size + draft_per_block)),
        draft_bytes_per_block=draft_per_block,
    )
