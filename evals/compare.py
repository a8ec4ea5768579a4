"""Compare EvalRuns against the first one (the baseline): accuracy deltas, per-question agreement, and for every
question whose text differs, whether it is a tie flip or an unexplained divergence (evals.divergence)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.core.speculative import SpecCounters
from evals.divergence import Divergence, Noise, explain, measure_noise, tie_margin
from evals.results import EvalRun, Metric, SampleResult


@dataclass
class Agreement:
    """How many common questions a plan answers like the baseline."""

    same: int
    total: int

    @property
    def fraction(self) -> float | None:
        """same / total, None when there is nothing to compare."""
        return self.same / self.total if self.total else None


@dataclass
class Disagreement:
    """A common question whose generated text differs from the baseline's, and why (a tie flip or unexplained)."""

    doc_id: int
    question: str
    gold: str
    baseline_text: str
    plan_text: str
    baseline_answers: dict[str, str]  # filter -> extracted answer
    plan_answers: dict[str, str]
    answers_differ: list[str]  # filters whose extracted answers differ too
    divergence: Divergence


@dataclass
class PlanColumn:
    """One plan's column in the comparison."""

    label: str
    error: str | None
    metrics: dict[str, Metric]  # filter -> lm-eval's metric on the plan's own samples
    n_samples: int
    common_accuracy: dict[str, float | None]  # filter -> accuracy on the common doc ids
    delta: dict[str, float | None]  # filter -> common_accuracy - baseline's common_accuracy
    answer_agreement: dict[str, Agreement]  # filter -> extracted answers equal to the baseline's
    text_agreement: Agreement | None  # generated text equal to the baseline's
    disagreements: list[Disagreement]
    tie_margin: float | None  # nats, for this plan's and the baseline's dtypes (None: the baseline column)
    noise: Noise | None  # how far logprobs moved from the baseline's where both generated on the same prefix
    wall_s: float | None
    generate_s: float | None
    generated_tokens: int | None
    tokens_per_s: float | None
    speculation: SpecCounters | None  # speculative decoding during the eval (None: the target has none)
    mode: str
    n_shot: int | None
    version: str | None

    @property
    def failed(self) -> bool:
        """True when the plan has no results."""
        return self.error is not None

    @property
    def tie_flips(self) -> int:
        return sum(d.divergence.tie_flip for d in self.disagreements)

    @property
    def unexplained(self) -> list[Disagreement]:
        """Disagreements that numerical noise does not explain (the ones to look at)."""
        return [d for d in self.disagreements if not d.divergence.tie_flip]


@dataclass
class Comparison:
    """Plans side by side; columns[0] is the baseline. Paired numbers use the common doc ids only."""

    task: str
    dataset: str
    version: str | None
    n_shot: int | None
    mode: str
    filters: list[str]
    columns: list[PlanColumn]
    common_doc_ids: list[int]
    notes: list[str] = field(default_factory=list)
    runs: list[EvalRun] = field(default_factory=list, repr=False)

    @property
    def baseline(self) -> PlanColumn:
        """The first column."""
        return self.columns[0]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (per-sample data stays in the per-plan sample files)."""
        d = asdict(self)
        d.pop("runs")
        d["n_common"] = len(self.common_doc_ids)
        for col, raw in zip(self.columns, d["columns"], strict=True):
            raw["failed"] = col.failed
            raw["tie_flips"] = col.tie_flips
            raw["unexplained_divergences"] = len(col.unexplained)
            raw["speculation"] = col.speculation.as_dict() if col.speculation else None
            if col.text_agreement is not None:
                raw["text_agreement"]["fraction"] = col.text_agreement.fraction
            for filt, agr in col.answer_agreement.items():
                raw["answer_agreement"][filt]["fraction"] = agr.fraction
        return d


def _common_ids(runs: list[EvalRun]) -> list[int]:
    ok = [r for r in runs if not r.failed]
    if not ok:
        return []
    common = set.intersection(*({s.doc_id for s in r.samples} for r in ok))
    return sorted(common)


def _accuracy(samples: dict[int, SampleResult], ids: list[int], filt: str) -> float | None:
    if not ids:
        return None
    return sum(samples[i].correct.get(filt, False) for i in ids) / len(ids)


def compare_runs(runs: list[EvalRun]) -> Comparison:
    """Build a Comparison of `runs` against runs[0]; failed runs stay in as columns with their reason."""
    if not runs:
        raise ValueError("compare_runs needs at least one run")
    ok = [r for r in runs if not r.failed]
    ref = ok[0] if ok else runs[0]
    filters: list[str] = []
    for r in ok:
        filters += [f for f in r.filters if f not in filters]
    common = _common_ids(runs)
    notes: list[str] = []

    sizes = {r.label: len(r.samples) for r in ok}
    if len(set(sizes.values())) > 1 or any(n != len(common) for n in sizes.values()):
        per = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        notes.append(f"sample sets differ ({per}); deltas and agreement use the {len(common)} doc ids they share")
    for attr, what in (
        ("task", "task"),
        ("version", "task version"),
        ("n_shot", "n-shot"),
        ("mode", "mode"),
        ("dtype", "model dtype"),
    ):
        values = {getattr(r, attr) for r in ok}
        if len(values) > 1:
            notes.append(f"runs differ in {what}: {', '.join(sorted(map(str, values)))}")

    base = runs[0]
    base_samples = {s.doc_id: s for s in base.samples}
    for run in ok[1:] if not base.failed else []:
        hashes = {s.doc_id: s.prompt_hash for s in run.samples}
        differ = sum(
            1
            for i in common
            if hashes.get(i) and base_samples[i].prompt_hash and hashes[i] != base_samples[i].prompt_hash
        )
        if differ:
            notes.append(f"{run.label}: {differ} of {len(common)} prompts differ from the baseline's")
    if base.failed:
        notes.append(f"baseline {base.label} failed ({base.error}); no deltas or agreement")
    unknown = [r.label for r in ok if r.dtype is None]
    if unknown and len(ok) > 1:
        notes.append(f"model dtype unknown for {', '.join(unknown)} (an endpoint): the 16-bit tie margin applies")
    base_acc = {f: None if base.failed else _accuracy(base_samples, common, f) for f in filters}

    columns = []
    for run in runs:
        samples = {s.doc_id: s for s in run.samples}
        paired = not run.failed and not base.failed
        common_acc = {f: None if run.failed else _accuracy(samples, common, f) for f in filters}
        delta: dict[str, float | None] = {}
        answer_agr: dict[str, Agreement] = {}
        text_agr = None
        disagreements: list[Disagreement] = []
        margin = noise = None
        for f in filters:
            a, b = common_acc[f], base_acc[f]
            delta[f] = a - b if paired and a is not None and b is not None else None
        if paired:
            for f in filters:
                same = sum(samples[i].extracted.get(f) == base_samples[i].extracted.get(f) for i in common)
                answer_agr[f] = Agreement(same=same, total=len(common))
            text_agr = Agreement(
                same=sum(samples[i].generated == base_samples[i].generated for i in common), total=len(common)
            )
            if run is not base:
                margin = tie_margin(base.dtype, run.dtype)
                traced = [(base_samples[i].trace, samples[i].trace) for i in common]
                noise = measure_noise([(b, p) for b, p in traced if b is not None and p is not None])
                for i in common:
                    mine, theirs = samples[i], base_samples[i]
                    if mine.generated == theirs.generated:
                        continue
                    disagreements.append(
                        Disagreement(
                            doc_id=i,
                            question=mine.question,
                            gold=mine.gold,
                            baseline_text=theirs.generated,
                            plan_text=mine.generated,
                            baseline_answers=dict(theirs.extracted),
                            plan_answers=dict(mine.extracted),
                            answers_differ=[f for f in filters if mine.extracted.get(f) != theirs.extracted.get(f)],
                            divergence=explain(theirs.trace, mine.trace, margin),
                        )
                    )
        columns.append(
            PlanColumn(
                label=run.label,
                error=run.error,
                metrics=dict(run.metrics),
                n_samples=len(run.samples),
                common_accuracy=common_acc,
                delta=delta,
                answer_agreement=answer_agr,
                text_agreement=text_agr,
                disagreements=disagreements,
                tie_margin=margin,
                noise=noise,
                wall_s=run.wall_s,
                generate_s=run.generate_s,
                generated_tokens=run.generated_tokens,
                tokens_per_s=run.tokens_per_s,
                speculation=run.speculation,
                mode=run.mode,
                n_shot=run.n_shot,
                version=run.version,
            )
        )
    return Comparison(
        task=ref.task,
        dataset=ref.dataset,
        version=ref.version,
        n_shot=ref.n_shot,
        mode=ref.mode,
        filters=filters,
        columns=columns,
        common_doc_ids=common,
        notes=notes,
        runs=list(runs),
    )
