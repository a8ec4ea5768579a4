"""What a server generated for one question, token by token: the token ids, their text, and the log-probabilities
of the chosen token and of its close rivals at every position, as recorded during the eval itself.

The eval asks the server for the top `TOP_LOGPROBS` alternatives of every generated token, named by token id
(`return_tokens_as_token_ids`, which dcpctl's server and vLLM honour). A trace keeps the alternatives within
`KEEP_WINDOW` nats of the best one, plus per position a bound that every token it does not list lies below, so a
token's log-probability is either known exactly or known to be below that bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

TOP_LOGPROBS = 20  # alternatives asked for per generated token (vLLM's default cap, max_logprobs=20)
KEEP_WINDOW = 5.0  # nats below the best token: alternatives kept (far beyond any tie margin)
_ID_PREFIX = "token_id:"
NO_BOUND = 0.0  # a log-probability is at most 0: the bound when the server listed no alternatives


def completions_trace_request() -> dict[str, Any]:
    """Fields that make a /v1/completions request return a trace."""
    return {"logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}


def chat_trace_request() -> dict[str, Any]:
    """Fields that make a /v1/chat/completions request return a trace."""
    return {"logprobs": True, "top_logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}


@dataclass
class TokenTrace:
    """One generation: per generated token its id, text, log-probability, close rivals, and the unlisted bound."""

    ids: list[int]
    pieces: list[str]  # each token's text ('' where the server's text does not reach it)
    logprobs: list[float]  # of the chosen token
    rivals: list[list[tuple[int, float]]]  # per position (token id, logprob) best first, the chosen token excluded
    bounds: list[float]  # per position: every token neither chosen nor among the rivals has a logprob below this

    def logprob(self, position: int, token: int) -> tuple[float, bool]:
        """(log-probability of `token` at `position`, exact); not exact: the value is an upper bound."""
        if self.ids[position] == token:
            return self.logprobs[position], True
        for rival, lp in self.rivals[position]:
            if rival == token:
                return lp, True
        return self.bounds[position], False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenTrace:
        rivals = [[(int(i), float(lp)) for i, lp in pos] for pos in d["rivals"]]
        return cls(**{**d, "rivals": rivals})


def _token_id(name: str) -> int | None:
    return int(name[len(_ID_PREFIX) :]) if name.startswith(_ID_PREFIX) and name[len(_ID_PREFIX) :].isdigit() else None


def _position(chosen: int, chosen_lp: float, listed: dict[int, float]) -> tuple[list[tuple[int, float]], float]:
    """Rivals within KEEP_WINDOW of the best and the bound for the rest, from the server's top list."""
    others = {i: lp for i, lp in listed.items() if i != chosen}
    if not others:
        return [], NO_BOUND
    # The server lists its top N, plus the chosen token when that is not among them: every unlisted token lies
    # below the smallest of the others. Rivals further than KEEP_WINDOW below the best are dropped too.
    floor = max(chosen_lp, *others.values()) - KEEP_WINDOW
    rivals = sorted(((i, lp) for i, lp in others.items() if lp >= floor), key=lambda e: -e[1])
    return rivals, max(min(others.values()), floor)


def _build(ids: list[int], pieces: list[str], lps: list[float], tops: list[dict[int, float]]) -> TokenTrace:
    rivals, bounds = [], []
    for token, lp, listed in zip(ids, lps, tops, strict=True):
        r, b = _position(token, lp, listed)
        rivals.append(r)
        bounds.append(b)
    return TokenTrace(ids=ids, pieces=pieces, logprobs=lps, rivals=rivals, bounds=bounds)


def trace_from_completion(choice: dict[str, Any]) -> TokenTrace | None:
    """The trace of one /v1/completions choice, or None when it carries no token-id logprobs."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not lp.get("tokens"):
        return None
    ids = [_token_id(str(t)) for t in lp["tokens"]]
    values = lp.get("token_logprobs") or []
    tops_raw = lp.get("top_logprobs") or [None] * len(ids)
    if any(i is None for i in ids) or any(v is None for v in values) or not len(values) == len(tops_raw) == len(ids):
        return None
    tops: list[dict[int, float]] = []
    for top in tops_raw:
        named = {_token_id(str(k)): float(v) for k, v in (top or {}).items()}
        tops.append({k: v for k, v in named.items() if k is not None})
    text = str(choice.get("text") or "")
    offsets = lp.get("text_offset") or []
    pieces = [""] * len(ids)
    if len(offsets) == len(ids):
        ends = [*offsets[1:], len(text)]
        pieces = [text[a:b] for a, b in zip(offsets, ends, strict=True)]
    return _build([int(i) for i in ids], pieces, [float(v) for v in values], tops)


def trace_from_chat(choice: dict[str, Any]) -> TokenTrace | None:
    """The trace of one /v1/chat/completions choice, or None when it carries no token-id logprobs."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not content:
        return None
    ids, pieces, values, tops = [], [], [], []
    for item in content:
        token = _token_id(str(item.get("token", "")))
        if token is None or item.get("logprob") is None:
            return None
        ids.append(token)
        pieces.append(bytes(item.get("bytes") or []).decode("utf-8", errors="replace"))
        values.append(float(item["logprob"]))
        listed = {_token_id(str(t.get("token", ""))): float(t["logprob"]) for t in item.get("top_logprobs") or []}
        tops.append({k: v for k, v in listed.items() if k is not None})
    return _build(ids, pieces, values, tops)
