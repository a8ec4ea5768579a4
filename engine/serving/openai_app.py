"""The OpenAI-compatible FastAPI app over an `EngineLoop`: its routes, its error handling, the small endpoints.

The generating endpoints live in `completions.py` and `chat.py`; every endpoint reads the served model through
`ServedModel`. User errors are 4xx in OpenAI's error shape and never stop the server.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.core.exports import ExportError
from engine.errors import UserError
from engine.serving.chat import ChatEndpoint
from engine.serving.completions import CompletionsEndpoint
from engine.serving.engine_loop import EngineLoop
from engine.serving.generation import json_response
from engine.serving.http import (
    ERROR_RESPONSES,
    BodyLimitMiddleware,
    JSONRoute,
    document_400_not_422,
    install_error_handlers,
)
from engine.serving.protocol import MAX_BODY_BYTES, DetokenizeRequest, TokenizeRequest, TransferRequest
from engine.serving.responses import ServerError
from engine.serving.served_model import ServedModel

_STREAMED = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events"}}


class OpenAIServer:
    """The FastAPI app over an `EngineLoop`, with the request handlers."""

    def __init__(self, engine_loop: EngineLoop, model_name: str):
        self.engine_loop = engine_loop
        self.model = ServedModel(engine_loop, model_name)
        self.instance_id = uuid.uuid4().hex  # this process: a router counts a new one behind a URL as a restart
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="dcpctl", version="1", docs_url=None, redoc_url=None)
        app.router.route_class = JSONRoute
        app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)
        install_error_handlers(app)
        for path, handler in (("/health", self.health), ("/v1/models", self.models)):
            app.get(path)(handler)
            app.head(path, include_in_schema=False)(handler)  # what load balancers probe with
        app.get("/v1/engine/stats")(self.engine_stats)
        app.get("/tokenizer_info")(self.tokenizer_info)
        app.post("/tokenize", responses=ERROR_RESPONSES)(self.tokenize)
        app.post("/detokenize", responses=ERROR_RESPONSES)(self.detokenize)
        completions = CompletionsEndpoint(self.model).completions
        app.post("/v1/completions", responses={**ERROR_RESPONSES, **_STREAMED})(completions)
        chat_completions = ChatEndpoint(self.model).chat_completions
        app.post("/v1/chat/completions", responses={**ERROR_RESPONSES, **_STREAMED})(chat_completions)
        app.get("/v1/kv_transfer/info", responses=ERROR_RESPONSES)(self.kv_transfer_info)
        app.post("/v1/kv_transfer/claim", responses=ERROR_RESPONSES)(self.kv_transfer_claim)
        app.post("/v1/kv_transfer/release", responses=ERROR_RESPONSES)(self.kv_transfer_release)
        document_400_not_422(app)
        return app

    def _prefill_handoff(self):
        handoff = self.model.engine.handoff
        if handoff.exports is None:
            raise ServerError(404, "this instance is not the prefill instance of a P/D deployment")
        return handoff

    async def kv_transfer_info(self):
        """P/D prefill: the instance's engine id, model fingerprint, layout and every rank's NIXL endpoint."""
        return self._prefill_handoff().info.to_json()

    async def kv_transfer_claim(self, req: TransferRequest):
        """P/D prefill: renew an export's lease and describe it (404 unknown, 410 released or expired)."""
        self._prefill_handoff()
        try:
            manifest = await self.engine_loop.call(lambda engine: engine.handoff.exports.claim(req.transfer_id))
        except ExportError as exc:
            raise ServerError(exc.status, str(exc), param="transfer_id") from None
        return manifest.to_json()

    async def kv_transfer_release(self, req: TransferRequest):
        """P/D prefill: free an export's blocks (a decode instance has read them)."""
        self._prefill_handoff()
        released = await self.engine_loop.call(lambda engine: engine.handoff.exports.release(req.transfer_id))
        return {"released": released}

    async def health(self):
        """200 while the engine runs; 503 after a fatal engine error or during shutdown."""
        if self.engine_loop.healthy:
            return {"status": "ok", "instance_id": self.instance_id}
        return JSONResponse({"status": "unhealthy", "error": self.engine_loop.unavailable_reason()}, status_code=503)

    async def models(self):
        """The served model: its id (`serve.model_name`, default the plan name) and `max_model_len`."""
        model = self.model
        return {
            "object": "list",
            "data": [
                {
                    "id": model.name,
                    "object": "model",
                    "created": model.created,
                    "owned_by": "dcpctl",
                    "root": str(model.engine.config.model_path),
                    "max_model_len": model.max_model_len,
                }
            ],
        }

    async def engine_stats(self):
        """KV blocks (used, free, peak), batch sizes and token counters, as of the engine's last iteration."""
        link = self.model.prefill_link
        return {
            "model": self.model.name,
            "healthy": self.engine_loop.healthy,
            "max_model_len": self.model.max_model_len,
            **self.engine_loop.stats,
            **({"prefill_link": link.stats()} if link is not None else {}),
        }

    async def tokenizer_info(self):
        """What lm-eval's remote tokenizer backend reads."""
        tok = self.model.tokenizer
        return {
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self.model.max_model_len,
        }

    async def tokenize(self, req: TokenizeRequest):
        """The prompt's token ids, as the model's tokenizer makes them (any length)."""
        self.model.check_model(req.model)
        ids = await self.model.tokenize(req.prompt, req.add_special_tokens)
        max_model_len = self.model.max_model_len
        return await json_response(lambda: {"tokens": ids, "count": len(ids), "max_model_len": max_model_len})

    async def detokenize(self, req: DetokenizeRequest):
        """The text of token ids (each within the vocabulary)."""
        self.model.check_model(req.model)
        vocab = len(self.model.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise UserError(f"tokens must be in 0..{vocab - 1} (got {bad[0]})")
        return {"prompt": self.model.tokenizer.decode(req.tokens)}
