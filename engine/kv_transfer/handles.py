"""What crosses the network and the per-step broadcast in a hand-off (plain data): a prefill instance's static
info, the claim's manifest, the handle the router passes on (vLLM's `kv_transfer_params`), one sequence's pull and
what each decode rank reports about it. Everything read from JSON is validated here; a bad value is a ValueError
naming the field."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any

from engine.attention.kv_layout import CacheGeometry
from engine.dcp import DcpSpec

LEASE_MARGIN_S = 1.0  # a pull starts only while the export's lease outlasts its deadline by this much

ROLES = ("prefill", "decode")
FAILURE_POLICIES = ("fail", "recompute")
_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class KVRole:
    """An instance's part in a prefill/decode deployment (from the P/D plan's `disagg` section)."""

    role: str  # "prefill" | "decode"
    lease_s: float = 300.0  # prefill: an unclaimed or unreleased export is freed after this
    transfer_timeout_s: float = 30.0  # decode: one pull gives up after this
    failure_policy: str = "fail"  # decode: "fail" the request, or "recompute" the prompt locally
    max_pulls_per_step: int = 16  # decode: sequences admitted with a pull in one step
    measure_raw: bool = False  # decode: also time one single-region READ of the same bytes (benchmarks)
    prefill_url: str | None = None  # decode: where the prefill instance answers


def _get(data: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(name) if isinstance(data, dict) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{where}: field {name} must be {names}")
    return value


def _int_list(data: Any, name: str, where: str) -> list[int]:
    values = _get(data, name, list, where)
    if not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"{where}: field {name} must be a list of non-negative integers")
    return values


@dataclass(frozen=True)
class RankEndpoint:
    """One prefill rank as a decode rank reaches it: its NIXL agent and where its KV storage lies."""

    rank: int
    agent: str
    metadata: bytes
    geometry: CacheGeometry
    memory: str  # "DRAM" | "VRAM"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "agent": self.agent,
            "metadata": base64.b64encode(self.metadata).decode(),
            "geometry": self.geometry.to_dict(),
            "memory": self.memory,
        }

    @classmethod
    def from_json(cls, data: Any) -> RankEndpoint:
        where = "prefill rank"
        memory = _get(data, "memory", str, where)
        if memory not in ("DRAM", "VRAM"):
            raise ValueError(f"{where}: field memory must be DRAM or VRAM")
        try:
            metadata = base64.b64decode(_get(data, "metadata", str, where), validate=True)
        except ValueError:
            raise ValueError(f"{where}: field metadata must be base64") from None
        return cls(
            rank=_get(data, "rank", int, where),
            agent=_get(data, "agent", str, where),
            metadata=metadata,
            geometry=CacheGeometry.from_dict(_get(data, "geometry", dict, where)),
            memory=memory,
        )


@dataclass(frozen=True)
class PrefillInfo:
    """A prefill instance's static facts (GET /v1/kv_transfer/info): identity, model, layout, ranks."""

    engine_id: str
    fingerprint: dict[str, Any]  # what must equal on both sides (model shape, cache dtype)
    tp: int
    dcp: int
    spec: DcpSpec
    ranks: list[RankEndpoint] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "fingerprint": self.fingerprint,
            "tp": self.tp,
            "dcp": self.dcp,
            "block_size": self.spec.block_size,
            "interleave": self.spec.interleave,
            "ranks": [r.to_json() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, data: Any) -> PrefillInfo:
        where = "prefill info"
        spec = DcpSpec(
            _get(data, "block_size", int, where), _get(data, "interleave", int, where), _get(data, "dcp", int, where)
        )
        if min(spec) < 1 or spec.block_size % spec.interleave:
            raise ValueError(
                f"{where}: block_size, interleave and dcp must be positive, interleave dividing block_size"
            )
        ranks = [RankEndpoint.from_json(r) for r in _get(data, "ranks", list, where)]
        if sorted(r.rank for r in ranks) != list(range(len(ranks))):
            raise ValueError(f"{where}: ranks must be numbered 0..{len(ranks) - 1}")
        return cls(
            engine_id=_get(data, "engine_id", str, where),
            fingerprint=_get(data, "fingerprint", dict, where),
            tp=_get(data, "tp", int, where),
            dcp=spec.dcp,
            spec=spec,
            ranks=sorted(ranks, key=lambda r: r.rank),
        )


def fingerprint(model: Any, cache_dtype: str) -> dict[str, Any]:
    """The facts of a model (a ModelInfo) and its cache that both sides of a hand-off must share."""
    return {
        "architecture": model.architecture,
        "num_layers": model.num_layers,
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "is_mla": model.is_mla,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "vocab_size": model.vocab_size,
        "cache_dtype": cache_dtype,
    }


def fingerprint_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Which facts differ ('name: decode X, prefill Y'), or None when the two sides match."""
    diffs = [f"{k}: decode {mine.get(k)!r}, prefill {theirs.get(k)!r}" for k in mine if mine.get(k) != theirs.get(k)]
    return "; ".join(diffs) or None


@dataclass(frozen=True)
class Manifest:
    """The claim's answer: the exported sequence's prefill block table and prompt, and its remaining lease."""

    transfer_id: str
    block_table: list[int]
    prompt_token_ids: list[int]
    expires_in_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "block_table": self.block_table,
            "prompt_token_ids": self.prompt_token_ids,
            "expires_in_s": self.expires_in_s,
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        where = "claim answer"
        return cls(
            transfer_id=_get(data, "transfer_id", str, where),
            block_table=_int_list(data, "block_table", where),
            prompt_token_ids=_int_list(data, "prompt_token_ids", where),
            expires_in_s=float(_get(data, "expires_in_s", (int, float), where)),
        )


def new_transfer_id() -> str:
    import uuid

    return uuid.uuid4().hex


def parse_handle(params: Any) -> tuple[str, str]:
    """(prefill engine id, transfer id) of a `kv_transfer_params` handle; ValueError when it is not one.

    Only these two fields are trusted: everything else (block ids, hosts) comes from the prefill instance the
    decode side is configured with, through the claim.
    """
    where = "kv_transfer_params"
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise ValueError(f"{where} must be the object a prefill instance returned (do_remote_prefill: true)")
    engine_id = _get(params, "remote_engine_id", str, where)
    transfer_id = _get(params, "remote_request_id", str, where)
    if not _ID.match(transfer_id) or not _ID.match(engine_id):
        raise ValueError(f"{where}: remote_engine_id and remote_request_id must be 32 hex digits")
    return engine_id, transfer_id


@dataclass(frozen=True)
class RemotePrefill:
    """A decode-side sequence's claimed export: where its prompt's KV is and until when."""

    source: PrefillInfo
    manifest: Manifest
    claimed_at: float  # time.monotonic() when the claim was answered
    prefill_url: str

    def lease_left_s(self, now: float) -> float:
        return self.manifest.expires_in_s - (now - self.claimed_at)


@dataclass
class KVPull:
    """One sequence's pull, as every decode rank gets it in the step: its positions [start, end)."""

    seq_id: int
    block_table: list[int]  # the decode side's
    start: int
    end: int
    source: PrefillInfo
    source_block_table: list[int]
    timeout_s: float
    measure_raw: bool = False


@dataclass
class PullReport:
    """What one decode rank did for one pull."""

    seq_id: int
    rank: int
    error: str | None = None
    descriptors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    raw_seconds: float | None = None
