"""Next-token sampling on rank 0: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from engine.core.sequence import SamplingParams, TokenLogprob
from engine.kernels import cpu_kernels

INVALID = -1  # the token id `sample` returns for a row with no distribution to draw from


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; fp32 rows on CPU take the engine's vectorized kernel (~5x torch's here)."""
    kernel = logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1
    if kernel and logits.shape[1] and cpu_kernels.cpu_kernels_available():
        return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token id per row of fp32 `logits` [S, V].

    A sampled (non-greedy) row whose distribution is not finite (NaN or +inf logits) gets `INVALID` instead of
    a token; the other rows are drawn exactly as they would be without it.
    """
    greedy_rows = [p.greedy for p in params]
    if all(greedy_rows):
        return greedy(logits)
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor(
        [1.0 if g else p.temperature for p, g in zip(params, greedy_rows, strict=True)], device=device
    ).unsqueeze(1)
    # shifted by the row max so that any temperature > 0 divides without overflow (softmax is shift-invariant);
    # a temperature below float32's range would round to 0 and divide 0 by 0
    finfo = torch.finfo(torch.float32)
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled, order = (shifted / temperature.clamp(finfo.tiny, finfo.max)).sort(dim=-1, descending=True)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    scaled = scaled.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = scaled.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    beyond = probs.cumsum(dim=-1) - probs > top_p  # drop a token once the mass before it exceeds top_p
    probs = probs.masked_fill(beyond, 0.0)
    no_distribution = ~(probs.sum(dim=-1) > 0)  # NaN anywhere in a row makes its sum NaN
    if no_distribution.any():
        probs[no_distribution] = 1.0  # something to draw from; the row's token is replaced below
    chosen = torch.empty(len(params), dtype=torch.int64, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        chosen[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
    for i, g in enumerate(generators):
        if g is not None:
            chosen[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    tokens = order.gather(1, chosen.unsqueeze(1)).squeeze(1)
    greedy_idx = [i for i, g in enumerate(greedy_rows) if g]
    if greedy_idx:
        tokens[greedy_idx] = greedy(logits[greedy_idx])
    return tokens.masked_fill(no_distribution & ~torch.tensor(greedy_rows, device=device), INVALID)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprob of each row's given token under the model distribution, plus its top-N alternatives."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    if top_n > 0:
        values, indices = logp.topk(top_n, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)]
