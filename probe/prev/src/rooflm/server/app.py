"""The FastAPI application: routes, API-key check, error handlers, metrics.

``build_app(engine)`` wires an :class:`AsyncLLMEngine` (already holding a loaded model) into an ASGI app; the app's
lifespan starts the engine thread and stops it at shutdown. ``rooflm serve`` (``launcher.py``) runs it with uvicorn;
tests may run it in-process.

Request bodies are read by the endpoints themselves, not by FastAPI: a body announced or found larger than
``max_body_bytes`` gets a 413 before anything is parsed (an announced size before a byte of it is read), a body
that stalls longer than ``body_timeout_s`` between chunks gets a 408, and the JSON is parsed and validated on the
preparation threads, off the event loop.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.server.errors import OpenAIError, error_body, install_error_handlers
from rooflm.server.metrics import CONTENT_TYPE, UNAUTHORIZED, ServerMetrics, outcome_for_status
from rooflm.server.openai_serving import OpenAIServing
from rooflm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

DEFAULT_MAX_BODY_MB = 32.0
DEFAULT_BODY_TIMEOUT_S = 30.0

# Generation endpoints: their error answers are counted in rooflm_requests_total{endpoint, outcome}.
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
# Routes that need the API key when one is set (health, metrics and the schema stay open, as in vLLM).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


def _schema(model: Any) -> dict[str, Any]:
    """OpenAPI description of a body the endpoint parses itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most ``max_bytes`` (413 otherwise, before the rest is read), each chunk within
    ``timeout_s`` (408 otherwise)."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.strip().isdigit() and int(announced) > max_bytes:
        raise OpenAIError(413, f"the request body has {int(announced)} bytes, more than the {max_bytes} this server "
                               "accepts (--max-request-body-mb)", code="request_too_large",
                          headers={"Connection": "close"})
    chunks: list[bytes] = []
    size = 0
    it = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(it.__anext__(), timeout=timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise OpenAIError(408, f"the request body did not arrive within {timeout_s:g} s",
                              code="request_timeout", headers={"Connection": "close"}) from None
        size += len(chunk)
        if size > max_bytes:
            raise OpenAIError(413, f"the request body is larger than the {max_bytes} bytes this server accepts "
                                   "(--max-request-body-mb)", code="request_too_large",
                              headers={"Connection": "close"})
        chunks.append(chunk)
    return b"".join(chunks)


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
              shutdown_engine: bool = True, max_body_mb: float = DEFAULT_MAX_BODY_MB,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, prep_workers: int = 2,
              tool_call_parser: str | None = None) -> FastAPI:
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine)
    max_body_bytes = int(max_body_mb * 2**20)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        serving.close()
        if shutdown_engine:  # after uvicorn drained the in-flight requests (graceful shutdown)
            await asyncio.to_thread(engine.shutdown, 0.0 if serving.stop_now else 10.0)

    app = FastAPI(title="rooflm", summary="OpenAI-compatible API of the rooflm engine", lifespan=lifespan)
    serving = OpenAIServing(engine, model_name, metrics, prep_workers=prep_workers, tool_call_parser=tool_call_parser)

    async def body_of(request: Request) -> bytes:
        try:
            return await read_body(request, max_body_bytes, body_timeout_s)
        except ClientDisconnect:
            raise OpenAIError(400, "the client disconnected before sending the whole body") from None

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

    @app.post("/v1/completions", openapi_extra=_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()  # the request's TTFT (and SLO-aware admission) count from here
        return await serving.create_completion(await body_of(request), request, arrival)

    @app.post("/v1/chat/completions", openapi_extra=_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        return await serving.create_chat_completion(await body_of(request), request, arrival)

    @app.post("/tokenize", openapi_extra=_schema(TokenizeRequest))
    async def tokenize(request: Request) -> dict[str, Any]:
        return await serving.tokenize(await body_of(request))

    @app.post("/detokenize", openapi_extra=_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        return await serving.detokenize(await body_of(request))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return serving.tokenizer_info()

    return app


__all__ = ["build_app", "APIKeyMiddleware", "OpenAIError"]
