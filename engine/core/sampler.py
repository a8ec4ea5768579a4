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


def _sorted_distribution(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's sampling distribution after temperature, top-k and top-p, over the vocabulary sorted by logit
    (descending): (probabilities, the sorted token ids, rows with no distribution: NaN or +inf logits, their
    probabilities set to 1 so that a draw does not fail). Greedy rows get temperature 1 (their draw is replaced)."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device).unsqueeze(1)
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
        probs[no_distribution] = 1.0  # something to draw from; the row's token is replaced by the caller
    return probs, order, no_distribution


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
    device = logits.device
    probs, order, no_distribution = _sorted_distribution(logits, params)
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


def distribution(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, list[bool]]:
    """Each row's sampling distribution (temperature, top-k, top-p) in vocabulary order, normalised; and which rows
    have none (NaN or infinite logits: their row is uniform over what top-k/top-p keep, not to be trusted)."""
    sorted_probs, order, no_distribution = _sorted_distribution(logits, params)
    # back in vocabulary order, and normalised (top-p leaves a row summing to less than 1)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    probs /= probs.sum(dim=-1, keepdim=True)
    return probs, no_distribution.tolist()


def verify(
    logits: torch.Tensor,
    draft: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The tokens a speculative step yields: the accepted prefix of `draft` and one token of the model's own.

    `logits` [len(draft) + 1, V]: row i is the next-token distribution after the i-th proposal (row 0: after the
    token before them). Greedy: proposals are accepted while each is the argmax, then the argmax follows.
    Sampled: rejection sampling (Leviathan et al. 2023). Proposal x was drawn from the draft's distribution q
    (`draft_probs` [len(draft), V], vocabulary order; None: the ngram proposer's point mass on x, q(x) = 1); it is
    accepted with probability min(1, p(x) / q(x)) (p: the row's distribution after temperature, top-k and top-p);
    on rejection the token is drawn from max(p - q, 0), renormalised (a point mass: p with x removed); after all
    are accepted the bonus token is drawn from the last row. Each token is thereby distributed exactly as without
    speculation. Draws use the request's generator (its seed) like `sample`. A row with no distribution ends the
    list with `INVALID`.
    """
    if params.greedy:
        targets = greedy(logits).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == targets[accepted]:
            accepted += 1
        return [*draft[:accepted], targets[accepted]]
    probs, invalid = distribution(logits, [params] * logits.shape[0])
    tokens: list[int] = []
    for row, proposal in enumerate(draft):
        if invalid[row]:
            return [*tokens, INVALID]
        p = probs[row]
        if draft_probs is None:
            q_x = 1.0
            residual = p.clone()
            residual[proposal] = 0.0
        else:
            q = draft_probs[row]
            q_x = float(q[proposal])
            residual = (p - q).clamp_(min=0.0)
        # accept with probability p(x) / q(x); a residual of no mass means p is q (up to rounding): accept
        u = float(torch.rand(1, generator=generator, device=p.device))
        if u * q_x < float(p[proposal]) or not residual.sum() > 0:
            tokens.append(proposal)
            continue
        return [*tokens, int(torch.multinomial(residual, 1, generator=generator)[0])]
    if invalid[len(draft)]:
        return [*tokens, INVALID]
    return [*tokens, int(torch.multinomial(probs[len(draft)], 1, generator=generator)[0])]


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
