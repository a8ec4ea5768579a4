"""Benchmark metrics from request timestamps: throughput, TTFT, TPOT and ITL (mean, p50, p99).

- TTFT: first chunk with text minus send time.
- TPOT: per request, (last token arrival - first token arrival) / (output tokens - 1); requests with one token
  have none. This is the decode time per token the request saw, prefill excluded.
- ITL: gaps between consecutive chunk arrivals, pooled over requests.
- Decode batch: the mean, over the ITL gaps, of the requests decoding when the gap ended (between their first and
  last token): the batch of the steps the ITL percentiles are made of (a server decodes every running sequence
  each step, so each gap is one step at that batch).
- Throughput: output tokens (and requests) of the successful requests over the run's wall time.
- Hand-off (P/D deployments, from each request's `kv_transfer`): descriptors, bytes and READ time per decode rank,
  the single-region READ of the same bytes when measured, and TTFT split into prefill, claim + queue, transfer
  and first decode.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from evals.bench.client import RequestRecord


@dataclass(frozen=True)
class Stat:
    """Mean, median, 99th percentile and minimum of a sample (seconds); all None for an empty sample."""

    mean: float | None
    p50: float | None
    p99: float | None
    n: int
    min: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        if not values:
            return cls(None, None, None, 0)
        arr = np.asarray(values, dtype=np.float64)
        return cls(
            float(arr.mean()),
            float(np.percentile(arr, 50)),
            float(np.percentile(arr, 99)),
            int(arr.size),
            float(arr.min()),
        )


@dataclass(frozen=True)
class HandoffMetrics:
    """What the requests' prefill -> decode hand-offs did (per decode rank: pooled over requests and ranks)."""

    requests: int
    descriptors_per_rank: float  # mean
    bytes_per_rank: float  # mean
    transfer: Stat  # one rank's READ time
    raw: Stat  # one rank's single-region READ of the same bytes (when the plan measures it)
    ratio: Stat  # transfer / raw, per request and rank
    prefill: Stat
    claim_queue: Stat
    transfer_ttft: Stat  # the slowest rank's READ: the part of TTFT the transfer takes
    first_decode: Stat


def handoff_of(records: list[RequestRecord]) -> HandoffMetrics | None:
    """The hand-off metrics of the successful requests that report one (None when none does)."""
    splits = [r.kv_transfer for r in records if r.ok and r.kv_transfer and "error" not in r.kv_transfer]
    if not splits:
        return None
    ranks = [rank for s in splits for rank in s.get("per_rank", [])]
    raw = [rank for rank in ranks if rank.get("raw_transfer_s")]
    return HandoffMetrics(
        requests=len(splits),
        descriptors_per_rank=float(np.mean([r["descriptors"] for r in ranks])) if ranks else 0.0,
        bytes_per_rank=float(np.mean([r["bytes"] for r in ranks])) if ranks else 0.0,
        transfer=Stat.of([r["transfer_s"] for r in ranks]),
        raw=Stat.of([r["raw_transfer_s"] for r in raw]),
        ratio=Stat.of([r["transfer_s"] / r["raw_transfer_s"] for r in raw]),
        prefill=Stat.of([s["prefill_s"] for s in splits if s.get("prefill_s") is not None]),
        claim_queue=Stat.of([s["claim_s"] + s["queue_s"] for s in splits]),
        transfer_ttft=Stat.of([s["transfer_s"] for s in splits]),
        first_decode=Stat.of([s["first_decode_s"] for s in splits if s.get("first_decode_s") is not None]),
    )


@dataclass(frozen=True)
class BenchMetrics:
    """What one target achieved on the workload."""

    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_throughput: float  # output tokens/s
    request_throughput: float  # requests/s
    total_token_throughput: float  # (input + output) tokens/s
    ttft: Stat
    tpot: Stat
    itl: Stat
    decode_batch: float | None  # requests decoding at the end of the mean ITL gap (module docstring)
    e2e: Stat
    short_requests: int  # successful requests with fewer output tokens than asked for (EOS honoured, ...)
    handoff: HandoffMetrics | None = None  # P/D deployments only

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tpot_of(rec: RequestRecord) -> float | None:
    """The request's time per output token after the first, or None with fewer than two tokens."""
    if not rec.ok or rec.output_tokens < 2 or not rec.token_times:
        return None
    return (rec.token_times[-1] - rec.token_times[0]) / (rec.output_tokens - 1)


def decode_batch(records: list[RequestRecord]) -> float | None:
    """The mean over every ITL gap of the requests decoding when it ended (first token arrived, last not yet
    passed); None without gaps."""
    ok = [r for r in records if r.ok and len(r.token_times) > 1]
    firsts = np.sort([r.token_times[0] for r in ok])
    lasts = np.sort([r.token_times[-1] for r in ok])
    ends = np.concatenate([r.token_times[1:] for r in ok]) if ok else np.empty(0)
    if not ends.size:
        return None
    decoding = np.searchsorted(firsts, ends, side="right") - np.searchsorted(lasts, ends, side="left")
    return float(decoding.mean())


def compute_metrics(records: list[RequestRecord], duration_s: float, output_len: int | None = None) -> BenchMetrics:
    """Aggregate the successful requests; `output_len` (what was asked for) counts the ones that came back short."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := tpot_of(r)) is not None]
    itls = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2es = [r.end_time - r.send_time for r in ok if r.end_time is not None]
    dur = max(duration_s, 1e-9)
    return BenchMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        input_tokens=in_tokens,
        output_tokens=out_tokens,
        output_throughput=out_tokens / dur,
        request_throughput=len(ok) / dur,
        total_token_throughput=(in_tokens + out_tokens) / dur,
        ttft=Stat.of(ttfts),
        tpot=Stat.of(tpots),
        itl=Stat.of(itls),
        decode_batch=decode_batch(ok),
        e2e=Stat.of(e2es),
        short_requests=sum(1 for r in ok if output_len is not None and r.output_tokens < output_len),
        handoff=handoff_of(records),
    )
