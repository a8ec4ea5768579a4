"""A prefill instance's exports (rank 0, plain data): finished prompts whose KV blocks it keeps for a decode
instance to READ, each under a lease.

A decode instance claims an export by its transfer id (which renews the lease and returns the manifest), READs
the blocks, and releases it; an export that nobody releases is freed when its lease runs out. Blocks stay
reserved meanwhile, so new prompts may wait for them (the lease bounds the wait).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.kv_transfer.handles import Manifest, new_transfer_id

_FORGOTTEN_KEPT = 4096  # ids of finished exports remembered, so that a late claim says "expired", not "unknown"


class ExportError(Exception):
    """A claim or release that cannot be served; `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Export:
    seq: Sequence
    expires_at: float


class Exports:
    """Transfer id -> the exported sequence and its lease."""

    def __init__(self, blocks: BlockManager, lease_s: float):
        self.blocks = blocks
        self.lease_s = lease_s
        self._live: dict[str, _Export] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> "released" | "expired"
        self.total = 0
        self.expired = 0
        self.released = 0

    def keep(self, seq: Sequence) -> str:
        """Hold a finished prompt's blocks under a new transfer id."""
        transfer_id = new_transfer_id()
        self._live[transfer_id] = _Export(seq, time.monotonic() + self.lease_s)
        self.total += 1
        return transfer_id

    def claim(self, transfer_id: str) -> Manifest:
        """Renew the lease and describe the export; ExportError 404 (unknown) or 410 (released or expired)."""
        export = self._live.get(transfer_id)
        if export is None:
            gone = self._gone.get(transfer_id)
            if gone is not None:
                raise ExportError(410, f"transfer {transfer_id} was {gone}; send the prompt again")
            raise ExportError(404, f"unknown transfer {transfer_id}")
        export.expires_at = time.monotonic() + self.lease_s
        seq = export.seq
        return Manifest(transfer_id, list(seq.block_table), seq.token_ids[: seq.num_prompt_tokens], self.lease_s)

    def release(self, transfer_id: str) -> bool:
        """Free an export's blocks (full blocks stay prefix-cached); False when it is not live."""
        export = self._live.pop(transfer_id, None)
        if export is None:
            return False
        self.blocks.release(export.seq)
        self.released += 1
        self._forget(transfer_id, "released")
        return True

    def expire(self) -> int:
        """Free every export whose lease has run out; how many."""
        now = time.monotonic()
        late = [t for t, e in self._live.items() if e.expires_at <= now]
        for transfer_id in late:
            self.blocks.release(self._live.pop(transfer_id).seq)
            self._forget(transfer_id, "expired")
        self.expired += len(late)
        return len(late)

    def next_expiry_s(self) -> float | None:
        """Seconds until the next lease runs out (None without exports)."""
        if not self._live:
            return None
        return max(0.0, min(e.expires_at for e in self._live.values()) - time.monotonic())

    def _forget(self, transfer_id: str, how: str) -> None:
        self._gone[transfer_id] = how
        while len(self._gone) > _FORGOTTEN_KEPT:
            self._gone.popitem(last=False)

    def stats(self) -> dict[str, int]:
        return {
            "exports_live": len(self._live),
            "exports_total": self.total,
            "exports_released": self.released,
            "exports_expired": self.expired,
            "export_blocks": sum(len(e.seq.block_table) for e in self._live.values()),
        }
