"""The FastAPI application: routes, API-key check, error handlers, metrics.

``build_app(engine)`` wires an :class:`AsyncLLMEngine` (already holding a loaded model) into an ASGI app; the app's
lifespan starts the engine thread and stops it at shutdown. ``rooflm serve`` (``launcher.py``) runs it with uvicorn;
tests may run it in-process.
"""
from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.server.errors import OpenAIError, error_body, install_error_handlers
from rooflm.server.metrics import CONTENT_TYPE, UNAUTHORIZED, ServerMetrics, outcome_for_status
from rooflm.server.openai_serving import OpenAIServing
from rooflm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

# Generation endpoints: their error answers are counted in rooflm_requests_total{endpoint, outcome}.
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
# Routes that need the API key when one is set (health, metrics and the schema stay open, as in vLLM).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would get between streaming responses and client disconnects).
    Checks ``Authorization: Bearer <key>`` before the body is even read."""

    def __init__(self, app: Any, api_key: str, on_reject: Callable[[str], None]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.on_reject = on_reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and path.startswith(_PROTECTED_PREFIXES):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not secrets.compare_digest(token, self.api_key):
                self.on_reject(path)
                message = "Incorrect API key provided" if token else "Missing API key: send 'Authorization: Bearer KEY'"
                response = JSONResponse(error_body(message, "authentication_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, *, api_key: str | None = None, served_model_name: str | None = None,
              shutdown_engine: bool = True) -> FastAPI:
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        if shutdown_engine:  # after uvicorn drained the in-flight requests (graceful shutdown)
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="rooflm", summary="OpenAI-compatible API of the rooflm engine", lifespan=lifespan)
    serving = OpenAIServing(engine, model_name, metrics)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving

    def on_error(request: Request, status: int) -> None:
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            metrics.count(endpoint, outcome_for_status(status))

    install_error_handlers(app, on_error)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           on_reject=lambda path: path in _ENDPOINTS and metrics.count(_ENDPOINTS[path], UNAUTHORIZED))

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(f"the engine is not running: {engine.dead_error}",
                                       "service_unavailable_error", None, "engine_unavailable"), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [serving.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return serving.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.create_chat_completion(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return serving.detokenize(body)

    return app


__all__ = ["build_app", "APIKeyMiddleware", "OpenAIError"]
