"""The hand-off as the OpenAI endpoints see it (vLLM's `kv_transfer_params` on requests and responses).

A prefill instance marks a request `{"do_remote_decode": true}` as an export and answers with the handle
(`do_remote_prefill: true`, its engine id and the transfer id). A decode instance trusts nothing in a handle but
those two ids: it claims the transfer from the prefill instance it is configured with (which renews the lease and
returns the authoritative block table and prompt), checks the prompt against its own tokenisation, queues the
sequence with a pull, and releases the export once every choice of that prompt has pulled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from engine.kv_transfer.handles import Manifest, PrefillInfo, RemotePrefill, fingerprint, fingerprint_mismatch
from engine.kv_transfer.handles import parse_handle as parse_kv_handle
from engine.serving.responses import ServerError

logger = logging.getLogger("dcpctl.server")

PREFILL_HTTP_TIMEOUT_S = 10.0  # a claim or release; a prefill instance that does not answer in time is failing


def wants_export(params: Any) -> bool:
    """A request that a router sent to a prefill instance for a decode instance to continue."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def handle_for(export: dict, engine_id: str, lease_s: float, tp_size: int) -> dict:
    """The handle a prefill instance answers with (vLLM's field names; block ids for information only)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": export["transfer_id"],
        "remote_block_ids": export["block_ids"],
        "tp_size": tp_size,
        "expires_in_s": lease_s,
    }


@dataclass
class Claimed:
    """One prompt's claimed export and how long the claim took."""

    remote: RemotePrefill
    claim_s: float
    prefill_s: float | None  # as the router measured it (echoed back)


class PrefillLink:
    """A decode instance's link to its prefill instance (HTTP): the instance's info, claims, releases."""

    def __init__(self, url: str, own_fingerprint: dict[str, Any]):
        self.url = url.rstrip("/")
        self.own_fingerprint = own_fingerprint
        self.info: PrefillInfo | None = None
        self.claims = 0
        self.releases = 0
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=PREFILL_HTTP_TIMEOUT_S, trust_env=False)
        return self._client

    async def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            return await self._http().request(method, self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise ServerError(
                502, f"the prefill instance {self.url} cannot be reached ({type(exc).__name__}: {exc})"
            ) from None

    async def source(self, engine_id: str) -> PrefillInfo:
        """The prefill instance's info, fetched again when a handle names another engine id (it restarted)."""
        if self.info is None or self.info.engine_id != engine_id:
            response = await self._request("GET", "/v1/kv_transfer/info")
            if response.status_code != 200:
                raise ServerError(
                    502, f"the prefill instance {self.url} did not describe itself (HTTP {response.status_code})"
                )
            try:
                info = PrefillInfo.from_json(response.json())
            except ValueError as exc:
                raise ServerError(502, f"the prefill instance {self.url} sent an invalid description: {exc}") from None
            mismatch = fingerprint_mismatch(self.own_fingerprint, info.fingerprint)
            if mismatch:
                raise ServerError(502, f"the prefill instance {self.url} runs another model or cache ({mismatch})")
            self.info = info
        if self.info.engine_id != engine_id:
            raise ServerError(
                400,
                f"kv_transfer_params: the handle is from prefill engine {engine_id}, but this decode instance pulls "
                f"from {self.url} (engine {self.info.engine_id}); send it to the decode instance of that deployment",
                param="kv_transfer_params",
            )
        return self.info

    async def claim(self, params: Any, prompt_ids: list[int]) -> Claimed:
        """Claim one prompt's export; a 400 for a bad, stale or foreign handle or another prompt, a 502 when the
        prefill instance fails."""
        try:
            engine_id, transfer_id = parse_kv_handle(params)
        except ValueError as exc:
            raise ServerError(400, str(exc), param="kv_transfer_params") from None
        source = await self.source(engine_id)
        start = time.perf_counter()
        response = await self._request("POST", "/v1/kv_transfer/claim", {"transfer_id": transfer_id})
        if response.status_code in (404, 410):
            raise ServerError(
                400,
                f"kv_transfer_params: unknown or expired transfer handle {transfer_id} "
                f"({_message(response)}); send the prompt through the router again",
                param="kv_transfer_params",
            )
        if response.status_code != 200:
            raise ServerError(502, f"the prefill instance {self.url} refused the claim: {_message(response)}")
        try:
            manifest = Manifest.from_json(response.json())
        except ValueError as exc:
            raise ServerError(502, f"the prefill instance {self.url} sent an invalid claim answer: {exc}") from None
        self.claims += 1
        if manifest.prompt_token_ids != prompt_ids:
            await self.release(transfer_id)
            raise ServerError(
                400,
                f"kv_transfer_params: transfer {transfer_id} holds another prompt than this request's "
                f"({len(manifest.prompt_token_ids)} tokens there, {len(prompt_ids)} here); send the same prompt",
                param="kv_transfer_params",
            )
        prefill_s = params.get("prefill_s")
        return Claimed(
            RemotePrefill(source, manifest, time.monotonic(), self.url),
            time.perf_counter() - start,
            float(prefill_s) if isinstance(prefill_s, int | float) and not isinstance(prefill_s, bool) else None,
        )

    async def release(self, transfer_id: str) -> None:
        """Tell the prefill instance it may free an export (best effort: its lease frees it otherwise)."""
        with contextlib.suppress(ServerError):
            response = await self._request("POST", "/v1/kv_transfer/release", {"transfer_id": transfer_id})
            if response.status_code == 200:
                self.releases += 1
                return
        logger.warning("releasing transfer %s on %s failed; its lease will free it", transfer_id, self.url)

    def release_later(self, transfer_id: str) -> None:
        """`release` in the background (from synchronous code, such as a generation being closed)."""
        with contextlib.suppress(RuntimeError):
            task = asyncio.get_running_loop().create_task(self.release(transfer_id))
            _background.add(task)
            task.add_done_callback(_background.discard)

    def stats(self) -> dict[str, Any]:
        return {"prefill_url": self.url, "claims": self.claims, "releases": self.releases}


_background: set[asyncio.Task] = set()


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


def own_fingerprint(engine: Any) -> dict[str, Any]:
    """The fingerprint a decode engine compares with its prefill instance's."""
    return fingerprint(engine.config.model, engine.config.cache_dtype)
