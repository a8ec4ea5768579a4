"""Why a plan's generation differs from the baseline's: a tie flip or an unexplained divergence.

At the first generated token where the two runs differ, the baseline chose token b and the plan token p, on the
same prefix. From both runs' recorded log-probabilities (evals.traces): the baseline's gap lp_base(b) - lp_base(p)
and the plan's gap lp_plan(p) - lp_plan(b). When both are within the tie margin of the runs' dtype, the two tokens
were a near-tie that a different summation order (the DCP LSE merge, another batch shape) can flip: a tie flip.
Otherwise the divergence is unexplained: numerical noise of that dtype does not move log-probabilities that far.

The margins come from measured noise (docs/results/gsm8k.md, "Tie flips"): over every position both runs
generated on the same prefix, how far the gap between the chosen token and each rival listed in both runs moved
from one run to the other. `Noise` is that measurement; every comparison reports it for its own runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from evals.traces import TOP_LOGPROBS, TokenTrace

TIE_FLIP = "tie flip"
UNEXPLAINED = "unexplained"

# Nats. benchmarks/tie_noise.py on GSM8K test questions 500-549 (docs/results/gsm8k.md, "Tie flips"): where a DCP
# plan and the baseline generated on the same prefix, the chosen-vs-rival gap moved by at most 9.0e-5 in float32 and
# 0.75 in bfloat16 (its logits are bf16 values, 0.125-0.25 apart at SmolLM2's scale). Margin = that with headroom.
# float16 is not measured (no fp16 CPU run): it rounds 8x finer than bfloat16, whose margin therefore bounds it.
TIE_MARGINS = {"float32": 1e-3, "bfloat16": 1.0, "float16": 1.0}


def tie_margin(*dtypes: str | None) -> float:
    """The tie margin for runs of these dtypes: the largest of theirs (an unknown dtype, an endpoint's, counts as
    16-bit)."""
    return max(TIE_MARGINS.get(d or "bfloat16", TIE_MARGINS["bfloat16"]) for d in dtypes)


@dataclass
class Divergence:
    """How one question's generation departs from the baseline's, and what kind of departure it is."""

    kind: str  # TIE_FLIP | UNEXPLAINED
    reason: str  # one line: the numbers behind the kind
    margin: float
    position: int | None = None  # index of the first generated token that differs (None: no token record)
    baseline_token: int | None = None
    plan_token: int | None = None
    baseline_piece: str = ""
    plan_piece: str = ""
    # [logprob of the baseline's token, logprob of the plan's token] in each run; exact False: an upper bound
    baseline_logprobs: tuple[float, float] | None = None
    baseline_exact: tuple[bool, bool] = (True, True)
    plan_logprobs: tuple[float, float] | None = None
    plan_exact: tuple[bool, bool] = (True, True)
    baseline_gap: float | None = None  # lp_base(baseline token) - lp_base(plan token); a lower bound if not exact
    plan_gap: float | None = None  # lp_plan(plan token) - lp_plan(baseline token); a lower bound if not exact

    @property
    def tie_flip(self) -> bool:
        return self.kind == TIE_FLIP


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists differ (one ending early counts), None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain(baseline: TokenTrace | None, plan: TokenTrace | None, margin: float) -> Divergence:
    """Classify a question whose generated text differs from the baseline's, from both runs' traces."""
    if baseline is None or plan is None:
        missing = "the baseline" if baseline is None else "the plan"
        return Divergence(UNEXPLAINED, f"no token logprobs recorded for {missing} (the server returned none)", margin)
    j = first_difference(baseline.ids, plan.ids)
    if j is None:
        return Divergence(UNEXPLAINED, "the token ids agree although the texts differ", margin)
    if j >= len(baseline.ids) or j >= len(plan.ids):
        shorter = "the baseline" if j >= len(baseline.ids) else "the plan"
        return Divergence(UNEXPLAINED, f"{shorter} stopped after {j} tokens while the other went on", margin, j)
    b, p = baseline.ids[j], plan.ids[j]
    bb, bb_exact = baseline.logprob(j, b)
    bp, bp_exact = baseline.logprob(j, p)
    pb, pb_exact = plan.logprob(j, b)
    pp, pp_exact = plan.logprob(j, p)
    base_gap, plan_gap = bb - bp, pp - pb
    d = Divergence(
        UNEXPLAINED,
        "",
        margin,
        position=j,
        baseline_token=b,
        plan_token=p,
        baseline_piece=baseline.pieces[j],
        plan_piece=plan.pieces[j],
        baseline_logprobs=(bb, bp),
        baseline_exact=(bb_exact, bp_exact),
        plan_logprobs=(pb, pp),
        plan_exact=(pb_exact, pp_exact),
        baseline_gap=base_gap,
        plan_gap=plan_gap,
    )
    gaps = f"gaps {base_gap:.4g} (baseline) and {plan_gap:.4g} (plan), margin {margin:g}"
    unlisted = [who for who, exact in (("baseline", bp_exact), ("plan", pb_exact)) if not exact]
    if unlisted:
        d.reason = (
            f"the other token is not among the {', '.join(unlisted)} run's top {TOP_LOGPROBS} close rivals: "
            f"{gaps} are lower bounds"
        )
    elif base_gap <= margin and plan_gap <= margin:
        d.kind, d.reason = TIE_FLIP, f"a near-tie: {gaps}"
    else:
        d.reason = f"beyond numerical noise: {gaps}"
    return d


@dataclass
class Noise:
    """How much log-probabilities moved between two runs where they generated on the same prefix."""

    positions: int  # token positions compared (before each question's first difference)
    pairs: int  # (chosen token, rival) pairs listed in both runs
    max_logprob_change: float | None  # largest |change| of the chosen token's logprob
    max_gap_change: float | None  # largest |change| of (chosen - rival)
    p99_gap_change: float | None


def measure_noise(pairs: list[tuple[TokenTrace, TokenTrace]]) -> Noise:
    """Noise over (baseline, plan) traces of the same questions, at every position before they differ."""
    lp_changes: list[float] = []
    gap_changes: list[float] = []
    for base, plan in pairs:
        shared = first_difference(base.ids, plan.ids)
        for j in range(len(base.ids) if shared is None else shared):
            lp_changes.append(abs(base.logprobs[j] - plan.logprobs[j]))
            plan_rivals = dict(plan.rivals[j])
            for rival, lp in base.rivals[j]:
                if rival in plan_rivals:
                    base_gap = base.logprobs[j] - lp
                    plan_gap = plan.logprobs[j] - plan_rivals[rival]
                    gap_changes.append(abs(base_gap - plan_gap))
    gap_changes.sort()
    return Noise(
        positions=len(lp_changes),
        pairs=len(gap_changes),
        max_logprob_change=max(lp_changes) if lp_changes else None,
        max_gap_change=gap_changes[-1] if gap_changes else None,
        p99_gap_change=gap_changes[min(len(gap_changes) - 1, int(0.99 * len(gap_changes)))] if gap_changes else None,
    )
