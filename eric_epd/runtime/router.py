"""The router-process pieces every server on the skeleton shares: the error handlers (including the last resort),
the engine client's lifetime and the engine-backed /health answer."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

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


async def engine_health(client: EngineClient, is_engine_alive: Callable[[], bool]) -> JSONResponse:
    """200 with queue depth and workers while the engine and every worker live; 503 naming the reason otherwise."""
    status = await client.status() if is_engine_alive() else None
    if status is None or not status.healthy:
        reason = client.dead_reason or (status.reason if status else "engine not answering")
        return JSONResponse({"status": "unhealthy", "reason": reason}, 503)
    return JSONResponse({"status": "ok", "queued_items": status.queued_items,
                         "running_items": status.running_items,
                         "worker_pids": [w.pid for w in status.workers],
                         "workers": [{"pid": w.pid, "cpus": w.cpus, "threads": w.threads}
                                     for w in status.workers]})


@asynccontextmanager
async def connected_client(config: RuntimeConfig, is_engine_alive: Callable[[], bool],
                           on_status: Callable[[EngineStatusMsg], None] | None = None) -> AsyncIterator[EngineClient]:
    """The router's EngineClient to an engine that is already running, for a lifespan; closed (and the engine told
    to stop) on the way out."""
    client = EngineClient(config, is_engine_alive, on_status=on_status)
    client.start()
    try:
        yield client
    finally:
        await client.close()


def add_status_routes(app: FastAPI, state: dict[str, Any], is_engine_alive: Callable[[], bool],
                      model_card: dict[str, Any]) -> None:
    """GET /health (the engine's answer, via state["client"]) and GET /v1/models (one card: `model_card`)."""

    @app.get("/health")
    async def health() -> JSONResponse:
        return await engine_health(state["client"], is_engine_alive)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"object": "model", "owned_by": "eric-epd", **model_card}]})
