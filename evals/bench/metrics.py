"""Benchmark metrics from request timestamps: throughput, TTFT, TPOT and ITL (mean, p50, p99).

- TTFT: first chunk with text minus send time.
- TPOT: per request, (last token arrival - first token arrival) / (output tokens - 1); requests with one token
  have none. This is the decode time per token the request saw, prefill excluded.
- ITL: gaps between consecutive chunk arrivals, pooled over requests.
- Throughput: output tokens (and requests) of the successful requests over the run's wall time.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from evals.bench.client import RequestRecord


@dataclass(frozen=True)
class Stat:
    """Mean, median and 99th percentile of a sample (seconds); all None for an empty sample."""

    mean: float | None
    p50: float | None
    p99: float | None
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        if not values:
            return cls(None, None, None, 0)
        arr = np.asarray(values, dtype=np.float64)
        return cls(float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), int(arr.size))


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
    e2e: Stat
    short_requests: int  # successful requests with fewer output tokens than asked for (EOS honoured, ...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tpot_of(rec: RequestRecord) -> float | None:
    """The request's time per output token after the first, or None with fewer than two tokens."""
    if not rec.ok or rec.output_tokens < 2 or not rec.token_times:
        return None
    return (rec.token_times[-1] - rec.token_times[0]) / (rec.output_tokens - 1)


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
        e2e=Stat.of(e2es),
        short_requests=sum(1 for r in ok if output_len is not None and r.output_tokens < output_len),
    )
