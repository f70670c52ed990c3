"""The router-process pieces every server on the skeleton shares: the error handlers (including the last resort),
the engine client's lifetime, and /health (liveness) and /ready (readiness) answered from the engine's heartbeat."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eric_epd.common.errors import ApiError, error_response
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.engine.client import EngineClient
from eric_epd.runtime.engine.messages import EngineStatusMsg

logger = logging.getLogger(__name__)


LastResort = Callable[[Request, str], JSONResponse | None]


def install_error_handlers(app: FastAPI, special: LastResort | None = None) -> None:
    """ApiError and HTTP errors in the JSON error shape; any other exception logged with its traceback and answered
    500 in that shape too (or in the shape `special` gives for its own routes)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _last_resort(request: Request, e: Exception) -> JSONResponse:
        """A failure no route expected: logged with its traceback, answered in the route's documented error shape."""
        logger.error("unhandled %s on %s %s", type(e).__name__, request.method, request.url.path, exc_info=e)
        message = f"internal error ({type(e).__name__}); the server goes on serving"
        answer = special(request, message) if special is not None else None
        return answer if answer is not None else error_response(500, message)


class EngineWatch(Protocol):
    """What the router knows of its engine without asking it (runtime/engine/process.py's EngineProcess)."""

    @property
    def pid(self) -> int | None:
        """The engine process's pid."""

    def is_alive(self) -> bool:
        """Whether the engine (or a worker it left) may still run; never blocks."""

    def heartbeat_age(self) -> float:
        """Seconds since the engine last found its workers alive; never blocks."""


STATUS_WAIT_S = 0.25
"""How long /health waits for the engine's own status; longer means a batch is running (the heartbeat decides)."""


def liveness_problem(client: EngineClient, engine: EngineWatch, timeout_s: float) -> str | None:
    """Why the server is dead (its engine or a worker exited, or the engine's heartbeat is older than
    `timeout_s`), or None while it lives, busy or not. Never waits."""
    if not engine.is_alive():
        return client.dead_reason or "engine process died"
    if client.dead_reason is not None:
        return client.dead_reason
    age = engine.heartbeat_age()
    if age > timeout_s:
        return f"engine silent for {age:.1f}s (--liveness-timeout {timeout_s:g}s)"
    return None


async def engine_health(client: EngineClient, engine: EngineWatch, timeout_s: float) -> JSONResponse:
    """Liveness: 200 while the engine and every worker live, "busy" while a batch keeps the engine from answering
    (its heartbeat, renewed during the batch, says it lives); 503 naming the reason once dead."""
    problem, status = liveness_problem(client, engine, timeout_s), None
    if problem is None:
        status = await client.status(STATUS_WAIT_S)
        unhealthy = status is not None and not status.healthy
        problem = status.reason if unhealthy else liveness_problem(client, engine, timeout_s)
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, 503)
    body: dict[str, Any] = {
        "status": "ok" if status is not None else "busy",
        "engine_pid": engine.pid,
        "heartbeat_age_s": round(engine.heartbeat_age(), 3),
    }
    last = status or client.last_status
    if last is not None:
        body.update(
            {
                "queued_items": last.queued_items,
                "running_items": last.running_items,
                "worker_pids": [w.pid for w in last.workers],
                "workers": [{"pid": w.pid, "cpus": w.cpus, "threads": w.threads} for w in last.workers],
            }
        )
    return JSONResponse(body)


def engine_readiness(
    client: EngineClient, engine: EngineWatch, timeout_s: float, room: Callable[[], str | None]
) -> JSONResponse:
    """Readiness: 200 while the server lives and would admit work now (`room` says why not, e.g. its queue is
    full or it is draining); 503 naming the reason otherwise. Never waits for the engine."""
    problem = liveness_problem(client, engine, timeout_s) or room()
    if problem is not None:
        return JSONResponse({"status": "not ready", "reason": problem}, 503)
    return JSONResponse({"status": "ready"})


@asynccontextmanager
async def connected_client(
    config: RuntimeConfig,
    is_engine_alive: Callable[[], bool],
    on_status: Callable[[EngineStatusMsg], None] | None = None,
) -> AsyncIterator[EngineClient]:
    """The router's EngineClient to an engine that is already running, for a lifespan; closed (and the engine told
    to stop) on the way out."""
    client = EngineClient(config, is_engine_alive, on_status=on_status)
    client.start()
    try:
        yield client
    finally:
        await client.close()


def add_status_routes(
    app: FastAPI,
    state: dict[str, Any],
    engine: EngineWatch,
    config: RuntimeConfig,
    model_card: dict[str, Any],
    room: Callable[[], str | None] = lambda: None,
) -> None:
    """GET /health (liveness: the engine and its workers live, busy or not), GET /ready (readiness: alive and
    `room` has none to object) and GET /v1/models (one card: `model_card`)."""

    @app.get("/health")
    async def health() -> JSONResponse:
        return await engine_health(state["client"], engine, config.liveness_timeout_s)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return engine_readiness(state["client"], engine, config.liveness_timeout_s, room)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"object": "model", "owned_by": "eric-epd", **model_card}]})
