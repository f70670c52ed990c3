"""The gateway's HTTP routes (OpenAI-compatible, images, admin, health, metrics) and its error handlers; each
route is thin and hands the work to the `Gateway`."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from epd_gateway.admission import RegistrationGate
from epd_gateway.boundary import check_request_fields
from epd_gateway.config import GatewayConfig
from epd_gateway.gateway import Gateway, read_json
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.openapi import gateway_openapi
from epd_gateway.redact import for_client
from eric_epd import __version__
from eric_epd.common.disconnect import ClientDisconnectedError, until_disconnect
from eric_epd.common.errors import ApiError, error_response, read_body
from eric_epd.common.http import bearer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class GatewayRoutes:
    """The routes of one gateway app; `gateway()` is the live `Gateway` (opened by the app's lifespan)."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, gateway: Callable[[], Gateway]) -> None:
        """Routes over `config` and `metrics`; the client's own key and ids are never forwarded upstream."""
        self.config, self.metrics, self.gateway = config, metrics, gateway
        self._upstream_headers = bearer(config.upstream_api_key)
        self._keys = [f"Bearer {k}".encode() for k in (config.api_key, config.admin_key) if k]
        self._metrics_keys = [f"Bearer {k}".encode() for k in (config.metrics_key, config.admin_key) if k]
        self._schema = gateway_openapi(__version__)
        self._gate = RegistrationGate(config.admin_key, config.register_from, config.eric_api_key)

    def routes(self) -> list[Route]:
        """Every route of the app."""
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/images/generations", self.images, methods=["POST"]),
            Route("/v1/images/files/{name}", self.image_file, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/admin/encoders", self.register, methods=["POST"]),
            Route("/admin/encoders", self.deregister, methods=["DELETE"]),
        ]

    def exception_handlers(self) -> dict:
        """ApiError, Starlette's 404/405 and any other failure, each answered in the documented error shape."""
        return {ApiError: self.on_api_error, HTTPException: self.on_http_error, Exception: self.last_resort}

    async def on_api_error(self, _: Request, e: Exception) -> Response:
        """Any ApiError, its 5xx text redacted (for_client); a 401 exactly as vLLM's API-key check answers it."""
        assert isinstance(e, ApiError)
        if e.status < 500:
            self.metrics.client_errors.labels(status=str(e.status)).inc()
        if e.status == 401:
            return JSONResponse({"error": "Unauthorized"}, 401)
        return error_response(e.status, for_client(e.status, e.message), param=e.param, retry_after=e.retry_after)

    async def on_http_error(self, request: Request, e: Exception) -> Response:
        """Unknown paths (404) and wrong methods (405), shaped like every other error."""
        assert isinstance(e, HTTPException)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return await self.on_api_error(request, ApiError(e.status_code, message))

    async def last_resort(self, request: Request, e: Exception) -> Response:
        """A failure no route expected: logged with its traceback, answered in the documented error shape."""
        logger.error("unhandled %s on %s %s", type(e).__name__, request.method, request.url.path, exc_info=e)
        return error_response(500, f"internal error ({type(e).__name__}); the gateway goes on serving")

    def _observe(self, path: str, start: float) -> None:
        self.metrics.requests.labels(path=path).inc()
        self.metrics.latency.labels(path=path).observe(time.perf_counter() - start)

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions: EPD or PD as the request's media decide; the path taken in `x-epd-path`."""
        gw = self.gateway()
        gw.check_api_key(request)
        gw.check_serves_chat()
        ran = await self._until_answer(
            request, "chat completion", lambda raw, body: gw.chat(raw, body, self._upstream_headers)
        )
        if ran is None:
            return Response(status_code=499)
        (path, response), start = ran
        self._observe(path, start)
        response.headers["x-epd-path"] = path
        return response

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: text only, straight to prefill/decode."""
        gw = self.gateway()
        gw.check_api_key(request)
        gw.check_serves_chat()

        async def complete(raw: bytes, body: dict[str, Any]) -> Response:
            validating = time.perf_counter()
            check_request_fields(body)
            self.metrics.stages.observe("validate", time.perf_counter() - validating)
            return await gw.upstreams.complete("/v1/completions", body, self._upstream_headers, raw)

        ran = await self._until_answer(request, "completion", complete)
        if ran is None:
            return Response(status_code=499)
        response, start = ran
        self._observe("pd", start)
        return response

    async def _until_answer(
        self, request: Request, what: str, work: Callable[[bytes, dict[str, Any]], Awaitable[T]]
    ) -> tuple[T, float] | None:
        """The body read (bounded, timed), then `work(raw, body)` while the client stays: its result and when the
        body was read; None if the client left first (while its body was read, or before the answer started: a
        chat's encode or an upstream call is then cancelled, leases of items already returned given back)."""
        try:
            reading = time.perf_counter()
            raw, body = await read_json(request, self.config.max_body_bytes)
            start = time.perf_counter()
            self.metrics.stages.observe("body_read", start - reading)
            return await until_disconnect(request, work(raw, body)), start
        except (ClientDisconnectedError, ClientDisconnect):
            logger.info("client left a %s before its answer started: its work was cancelled", what)
            return None

    async def images(self, request: Request) -> Response:
        """POST /v1/images/generations: text encoder, then a Geri; 404 when not configured."""
        gw = self.gateway()
        gw.check_api_key(request)
        if gw.images is None:
            raise ApiError(404, "image generation is not configured (--text-encoder-urls, --geri-urls)")
        raw = await read_body(request, self.config.max_body_bytes)
        start = time.perf_counter()
        try:
            answer = await until_disconnect(request, gw.images.generate(raw, str(request.base_url).rstrip("/")))
        except (ClientDisconnectedError, ClientDisconnect):
            return Response(status_code=499)
        self._observe("images", start)
        return JSONResponse(answer)

    async def image_file(self, request: Request) -> Response:
        """A stored image; its unguessable name is the capability (no API key, as OpenAI's image URLs)."""
        images = self.gateway().images
        png = images.store.get(request.path_params["name"]) if images is not None else None
        if png is None:
            raise ApiError(404, "no such image (unknown, or expired)")
        return Response(png, media_type="image/png")

    async def models(self, request: Request) -> Response:
        """GET /v1/models, as the prefill/decode engine answers it."""
        gw = self.gateway()
        gw.check_api_key(request)
        gw.check_serves_chat()
        return await gw.upstreams.get("/v1/models", self._upstream_headers)

    async def health(self, request: Request) -> JSONResponse:
        """Up for anyone; the encoders' URLs and loads only for a caller with the clients' or the admin key."""
        given = request.headers.get("authorization", "").encode()
        if not any(hmac.compare_digest(given, key) for key in self._keys):
            return JSONResponse({"status": "ok"})
        encoders = self.gateway().encoders
        return JSONResponse(
            {
                "status": "ok",
                "encoders": encoders.status(),
                "encoder_load": encoders.loads(),
                "recommended_encoders": encoders.recommended(),
            }
        )

    async def openapi(self, _: Request) -> JSONResponse:
        """The gateway's OpenAPI schema."""
        return JSONResponse(self._schema)

    async def prometheus(self, request: Request) -> Response:
        """The gateway's Prometheus metrics, for a caller with the metrics or the admin key (they name the encoders
        and tell their health)."""
        given = request.headers.get("authorization", "").encode()
        if not any(hmac.compare_digest(given, key) for key in self._metrics_keys):
            raise ApiError(401, "/metrics needs the gateway's metrics key (--metrics-key) or its admin key")
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def register(self, request: Request) -> JSONResponse:
        """POST /admin/encoders: an Eric joins (admin key or a registration proof from an allowed network)."""
        url = await self._gate.admit(request, joining=True)
        self.gateway().encoders.register(url)
        return JSONResponse({"encoders": self.gateway().encoders.urls})

    async def deregister(self, request: Request) -> JSONResponse:
        """DELETE /admin/encoders: an Eric leaves; 404 when it was not registered."""
        url = await self._gate.admit(request, joining=False)
        if not self.gateway().encoders.deregister(url):
            raise ApiError(404, f"encoder {url} is not registered")
        return JSONResponse({"encoders": self.gateway().encoders.urls})
