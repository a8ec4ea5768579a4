"""The sampler on hostile rows: a row without a finite distribution is marked, not raised, and leaves the other rows'
draws exactly as they would be without it; extreme temperatures and top_k values sample without NaN."""

from __future__ import annotations

import torch

from engine.core.sampler import INVALID, sample
from engine.core.sequence import SamplingParams


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _seeded(params: list[SamplingParams]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + i) for i in range(len(params))]


def test_a_nan_row_is_invalid_and_the_other_rows_draw_as_without_it():
    logits = _logits(4)
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(4)]
    clean = sample(logits, params, _seeded(params))
    assert (clean >= 0).all()
    for bad in (float("nan"), float("inf")):
        poisoned = logits.clone()
        poisoned[1, 7] = bad
        tokens = sample(poisoned, params, _seeded(params))
        assert tokens[1] == INVALID
        assert tokens[[0, 2, 3]].tolist() == clean[[0, 2, 3]].tolist()
    # unseeded rows too: the batch's draw does not raise
    tokens = sample(poisoned, [SamplingParams(temperature=1.0)] * 4, [None] * 4)
    assert tokens[1] == INVALID and (tokens[[0, 2, 3]] >= 0).all()


def test_a_nan_temperature_fails_only_its_row():
    """The engine validates temperatures; this is the sampler's own guard if one gets through."""
    logits = _logits(2)
    params = [SamplingParams(temperature=float("nan")), SamplingParams(temperature=0.7, seed=3)]
    tokens = sample(logits, params, [None, torch.Generator().manual_seed(3)])
    alone = sample(logits[1:], params[1:], [torch.Generator().manual_seed(3)])
    assert tokens.tolist() == [INVALID, alone.item()]


def test_greedy_rows_in_a_mixed_batch_are_argmax_even_with_nan():
    logits = _logits(3)
    logits[0, 4] = float("nan")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(top_k=1)]
    tokens = sample(logits, params, [None] * 3)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert tokens[1] >= 0


def test_extreme_temperatures_and_top_k():
    logits = _logits(2, vocab=1000)
    tiny = [SamplingParams(temperature=t) for t in (1e-30, 1e-320)]  # below float32's range: rounds to 0
    assert sample(logits, tiny, [None, None]).tolist() == logits.argmax(dim=-1).tolist()
    huge = [SamplingParams(temperature=1e300)] * 2  # near-uniform, no NaN
    draws = torch.stack([sample(logits, huge, [None, None]) for _ in range(200)])
    assert (draws >= 0).all() and len(draws.unique()) > 100
    top_k = [SamplingParams(temperature=1.0, top_k=10**30), SamplingParams(temperature=1.0, top_k=2)]
    for _ in range(20):
        first, second = sample(logits, top_k, [None, None]).tolist()
        assert 0 <= first < 1000 and second in logits[1].topk(2).indices.tolist()
