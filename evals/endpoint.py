"""Talking to an OpenAI-compatible endpoint: its root URL, its model ids, and (a dcpctl server's) engine stats.

`StatsWatch` is the one poller of GET /v1/engine/stats while a measurement runs: it hands every sample to a
callback (the progress line) and keeps the number of running sequences. A server without the endpoint (vLLM)
is left alone after its first 404.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx

from engine.errors import UserError

_ENDPOINT_SUFFIXES = ("/v1/chat/completions", "/v1/completions", "/v1")


def normalize_base_url(base_url: str) -> str:
    """Server root from any of 'http://h:p', '.../v1', '.../v1/completions', '.../v1/chat/completions'."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"base URL {base_url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
    for suffix in _ENDPOINT_SUFFIXES:
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def check_server(base_url: str, timeout_s: float = 5.0) -> list[str]:
    """Check the server answers; return the model ids of GET /v1/models ([] if only /health answers)."""
    root = normalize_base_url(base_url)
    # trust_env=False: lm-eval's aiohttp client ignores proxy variables too, so check the same route.
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        try:
            resp = client.get(f"{root}/v1/models")
            if resp.status_code == 200:
                data = resp.json().get("data", [])
                return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
            health = client.get(f"{root}/health")
        except (httpx.HTTPError, ValueError) as exc:
            raise UserError(
                f"cannot reach the server at {root} ({type(exc).__name__}: {exc}); "
                "start it with `dcpctl run PLAN` or pass the right --base-url"
            ) from None
    if health.status_code == 200:
        return []
    raise UserError(
        f"server at {root} answered GET /v1/models with {resp.status_code} and /health with "
        f"{health.status_code}; is it an OpenAI-compatible server? Check --base-url"
    )


def served_model(base_url: str) -> str | None:
    """The first model id of GET /v1/models (vLLM requires it in requests), or None."""
    ids = check_server(base_url)
    return ids[0] if ids else None


def engine_stats(base_url: str) -> dict[str, Any]:
    """The server's /v1/engine/stats, or {} when it has none (not a dcpctl server)."""
    try:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            resp = client.get(f"{base_url}/v1/engine/stats")
        return resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


class StatsWatch:
    """Poll GET /v1/engine/stats every `period_s` while the block runs; each sample (a dict with at least
    `running`) goes to `on_stats`."""

    def __init__(self, base_url: str, on_stats: Callable[[dict[str, Any]], None], period_s: float = 1.0) -> None:
        self.url, self.on_stats, self.period_s = f"{base_url}/v1/engine/stats", on_stats, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcpctl-engine-stats", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while not self._stop.wait(self.period_s):
                try:
                    resp = client.get(self.url)
                    if resp.status_code == 404:
                        return  # not a dcpctl server (vLLM, ...): nothing to show
                    stats = resp.json()
                except (httpx.HTTPError, ValueError):
                    continue
                if isinstance(stats, dict) and "running" in stats:
                    self.on_stats(stats)

    def __enter__(self) -> StatsWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
