"""Plain data for one evaluated plan: metrics per lm-eval filter, per-question samples, timings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.core.speculative import SpecCounters
from evals.traces import TokenTrace


@dataclass
class Metric:
    """One lm-eval aggregate, e.g. exact_match under the strict-match filter."""

    name: str  # lm-eval metric name (exact_match)
    value: float
    stderr: float | None  # None where lm-eval reports "N/A" (a single sample)


@dataclass
class SampleResult:
    """One question as one plan answered it."""

    doc_id: int
    question: str
    target: str  # lm-eval's target (gsm8k: the whole reference solution ending '#### N')
    generated: str  # the full generated text, as the server returned it
    extracted: dict[str, str] = field(default_factory=dict)  # filter -> extracted answer ("[invalid]": none)
    correct: dict[str, bool] = field(default_factory=dict)  # filter -> exact_match == 1
    prompt_hash: str | None = None
    trace: TokenTrace | None = None  # the generated tokens and their logprobs, when the server returned them

    @property
    def gold(self) -> str:
        """The reference final answer (text after '####')."""
        return self.target.split("####")[-1].strip()


@dataclass
class EvalRun:
    """lm-eval gsm8k on one plan (or endpoint); `error` set means the plan failed and has no results."""

    label: str
    task: str = ""  # lm-eval task name
    dataset: str = ""  # display name (says SYNTHETIC when it is)
    version: str | None = None
    n_shot: int | None = None
    mode: str = "completions"  # completions | chat
    metrics: dict[str, Metric] = field(default_factory=dict)  # filter -> metric
    samples: list[SampleResult] = field(default_factory=list)
    wall_s: float | None = None  # the whole simple_evaluate call
    generate_s: float | None = None  # time inside generate_until (the requests), when known
    generated_tokens: int | None = None  # sum of usage.completion_tokens; None if any response lacked it
    prompt_tokens: int | None = None
    base_url: str | None = None
    model: str | None = None
    dtype: str | None = None  # the plan's resolved model dtype (None: an endpoint, unknown)
    speculation: SpecCounters | None = None  # speculative decoding during the eval (None: the target has none)
    error: str | None = None

    @property
    def failed(self) -> bool:
        """True when the plan produced no results."""
        return self.error is not None

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of request time (falls back to wall time)."""
        secs = self.generate_s if self.generate_s else self.wall_s
        if self.generated_tokens is None or not secs:
            return None
        return self.generated_tokens / secs

    @property
    def filters(self) -> list[str]:
        """Filter names in lm-eval's order."""
        return list(self.metrics)

    @classmethod
    def failure(cls, label: str, reason: str, **kw: Any) -> EvalRun:
        """A run that failed (server did not start, requests failed, ...): still one column in reports."""
        return cls(label=label, error=reason, **kw)

    def to_dict(self, *, with_samples: bool = True) -> dict[str, Any]:
        """JSON-ready dict; `from_dict` reverses it."""
        d = asdict(self)
        if not with_samples:
            d.pop("samples")
        d["tokens_per_s"] = self.tokens_per_s
        d["speculation"] = self.speculation.as_dict() if self.speculation else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalRun:
        """Rebuild an EvalRun saved with `to_dict`."""
        d = dict(d)
        d.pop("tokens_per_s", None)
        if d.get("speculation") is not None:
            d["speculation"] = SpecCounters.since(None, d["speculation"])
        d["metrics"] = {k: Metric(**m) for k, m in d.get("metrics", {}).items()}
        d["samples"] = [
            SampleResult(**{**s, "trace": TokenTrace.from_dict(s["trace"]) if s.get("trace") else None})
            for s in d.get("samples", [])
        ]
        return cls(**d)
