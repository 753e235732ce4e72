"""The Sanic app: routes, the API-key and readiness guard on /v1/*, JSON errors, and the engine-thread listeners.

Run it in one process (`single_process=True`): that process imports JAX once and owns the accelerator. The engine
is built and warmed in the engine thread started by a listener, never at import; until it is ready /health and
/v1/* answer 503. If the engine fails, at start-up or later, the server stops.
"""

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable

from sanic import Request, Sanic, response
from sanic.exceptions import SanicException

from jaxllm.engine.engine import LLMEngine
from jaxllm.server import DEFAULT_RESPONSE_TIMEOUT_S, DEFAULT_SSE_KEEPALIVE_S, check_sse_keepalive
from jaxllm.server.engine_loop import EngineLoop, not_ready_error
from jaxllm.server.generation import ServingState, handle_generation
from jaxllm.server.metrics import ServerMetrics
from jaxllm.server.protocol import APIError, SamplingDefaults, check_model, internal_error

logger = logging.getLogger("jaxllm.server")

APP_NAME = "jaxllm"


def create_app(build_engine: Callable[[], LLMEngine], *, model_name: str,
               sampling_defaults: SamplingDefaults | None = None, api_key: str | None = None,
               response_timeout: float = DEFAULT_RESPONSE_TIMEOUT_S,
               sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S) -> Sanic:
    """The app; build_engine runs in the engine thread once the server listens."""
    check_sse_keepalive(sse_keepalive_s)
    app = Sanic(APP_NAME, configure_logging=False)  # its records go to the root logger the CLI configures
    app.config.RESPONSE_TIMEOUT = response_timeout
    metrics = ServerMetrics(lambda: engine_loop.engine)
    engine_loop = EngineLoop(build_engine, metrics)
    app.ctx.serving = ServingState(engine_loop, model_name, sampling_defaults or SamplingDefaults(), sse_keepalive_s)
    app.ctx.metrics = metrics
    app.ctx.started = int(time.time())
    _add_listeners(app, engine_loop)
    _add_guard(app, engine_loop, api_key)
    _add_routes(app)
    _add_error_handlers(app)
    return app


def _add_listeners(app: Sanic, engine_loop: EngineLoop) -> None:
    @app.after_server_start
    async def start_engine(app):
        engine_loop.start(asyncio.get_running_loop(), on_failure=app.stop)

    # after the drain: Sanic stops listening, waits (up to its graceful timeout) for open requests, then runs this;
    # stopping the engine before the drain froze every running stream until the timeout reset it
    @app.after_server_stop
    async def stop_engine(app):
        engine_loop.stop()


def _key_digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def _add_guard(app: Sanic, engine_loop: EngineLoop, api_key: str | None) -> None:
    """/v1/* needs the key (compared in constant time) and a ready engine; /health, /metrics and OPTIONS (a CORS
    preflight carries no key) stay open, as vLLM's."""
    expected = _key_digest(f"Bearer {api_key}") if api_key else None

    @app.on_request
    async def guard(request: Request):
        if request.method == "OPTIONS" or not request.path.startswith("/v1/"):
            return None
        given = request.headers.get("authorization", "")
        if expected is not None and not hmac.compare_digest(_key_digest(given), expected):
            return _error(APIError(401, "Incorrect or missing API key; send `Authorization: Bearer <key>`.",
                                   code="invalid_api_key"))
        if not engine_loop.ready:
            return _error(not_ready_error(engine_loop.failure), headers={"Retry-After": "1"})
        return None


def _add_routes(app: Sanic) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle_generation(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle_generation(request, chat=True)

    def model_card(request: Request) -> dict:
        serving: ServingState = request.app.ctx.serving
        return {"id": serving.model_name, "object": "model", "created": request.app.ctx.started,
                "owned_by": "jaxllm", "max_model_len": serving.engine_loop.engine.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        return response.json({"object": "list", "data": [model_card(request)]})

    @app.get("/v1/models/<model_id:path>")  # the OpenAI client's models.retrieve; ids may hold slashes
    async def model(request: Request, model_id: str):
        card = model_card(request)
        check_model({"model": model_id}, card["id"])
        return response.json(card)

    @app.get("/health")
    async def health(request: Request):
        engine_loop = request.app.ctx.serving.engine_loop
        if engine_loop.ready:
            return response.json({"status": "ready"})
        status = "failed" if engine_loop.failure is not None else "loading"
        return response.json({"status": status}, status=503)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = request.app.ctx.metrics.render()
        return response.raw(body, content_type=content_type)


def _error(error: APIError, headers: dict | None = None):
    return response.json(error.body(), status=error.status, headers=headers)


def _add_error_handlers(app: Sanic) -> None:
    @app.exception(APIError)
    async def api_error(request: Request, error: APIError):
        return _error(error)

    @app.exception(SanicException)
    async def http_error(request: Request, error: SanicException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return _error(APIError(error.status_code, str(error), type=kind))

    @app.exception(Exception)
    async def unexpected_error(request: Request, error: Exception):
        logger.exception("error while serving %s %s", request.method, request.path)
        return _error(internal_error(error))
