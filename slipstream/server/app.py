"""The FastAPI app: OpenAI's routes, /health, /metrics, /tokenize, /detokenize; errors, keys, limits, drain.

`build_app(engine, served_model_name, api_key, limits)` wraps a synchronous LLMEngine in an
AsyncLLMEngine whose thread lives as long as the app (started and stopped by the app's
lifespan), and gives the app its own metrics registry. Route logic lives in serving.py;
this file only wires it and turns every failure into OpenAI's error JSON. Around the
routes, outermost first: the drain (503 while shutting down), the API key (401), the
body-size limit (413).
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.engine.async_engine import AsyncLLMEngine, EngineDeadError
from slipstream.engine.engine import LLMEngine
from slipstream.metrics import CONTENT_TYPE, ServerMetrics
from slipstream.server import protocol as p
from slipstream.server.auth import APIKeyMiddleware
from slipstream.server.body_limit import BodyLimitMiddleware
from slipstream.server.drain import Drain, DrainMiddleware
from slipstream.server.errors import APIError, validation_error
from slipstream.server.limits import ServerLimits
from slipstream.server.serving import ClientDisconnected, OpenAIServing


def build_app(engine: LLMEngine, served_model_name: str | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    served_model_name = served_model_name or engine.config.model
    limits = limits or ServerLimits()
    async_engine = AsyncLLMEngine(engine)
    metrics = ServerMetrics(served_model_name, async_engine.stats)
    async_engine.on_output = metrics.record
    serving = OpenAIServing(async_engine, served_model_name, limits)

    async def end_requests(reason: str) -> None:
        """What the drain calls for requests still running at its end: stop the engine under them."""
        await asyncio.to_thread(async_engine.shutdown, reason=reason)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="slipstream", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.drain = Drain()
    app.state.end_requests = end_requests
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    _add_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not async_engine.is_alive:
            raise EngineDeadError("the engine is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, raw: Request) -> Response:
        return await serving.completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> dict:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> dict:
        return await serving.detokenize(body)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        messages = {404: f"no route {request.method} {request.url.path}",
                    405: f"method {request.method} is not allowed on {request.url.path}"}
        message = messages.get(exc.status_code, exc.detail)
        return APIError(exc.status_code, message).response(headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return APIError(503, str(exc)).response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's code for it

