"""The HTTP routes of SGLang's encoder server (sglang/srt/disaggregation/encoder/http_server.py), mounted in Eric's
own app so parts leave straight from the embedding pool."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from eric_epd.common.errors import ApiError, read_json_body
from eric_epd.eric.answers import OutputSpec
from eric_epd.eric.config import EricConfig
from eric_epd.eric.sglang.encoder import SglangEncoder
from eric_epd.eric.sglang.protocol import sglang_error_response, sglang_video_seconds, wire_dtype
from eric_epd.eric.sglang.registration import register, unregister
from eric_epd.models.facts import ModelFacts
from eric_epd.transfer.producer import TransferHub
from eric_epd.wire.sglang import EncodeRequest, MetaRequest, ReceiveUrlRequest, SendRequest

logger = logging.getLogger(__name__)

SMALL_BODY_BYTES = 1 << 20
"""Limit for the rank routes' bodies (a few hundred bytes of JSON; a NIXL session adds a few KiB)."""


def sglang_routes(
    config: EricConfig, facts: ModelFacts, spec: OutputSpec, hub: TransferHub, state: dict[str, Any]
) -> APIRouter:
    """The SGLang encoder endpoints over Eric's EncodeService (`state["service"]`, set by Eric's lifespan), for the
    checkpoint `facts` describe, whose encoder output is `spec`."""
    settings = config.sglang
    if not settings.enabled:
        return APIRouter()
    wire = wire_dtype(settings.dtype, facts.config)
    encoder = SglangEncoder(
        config, hub, state, settings, spec.width, spec.dtype, wire, facts.modalities, sglang_video_seconds(facts.config)
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        encoder.start()
        client = httpx.AsyncClient(timeout=5.0)
        for bootstrap in settings.register_urls:
            encoder._spawn(register(client, bootstrap, config.public_url, settings))
        try:
            yield
        finally:
            await unregister(client, config.public_url, settings)
            await encoder.stop()
            await client.aclose()

    router = APIRouter(lifespan=lifespan)

    async def run(
        request: Request, kind: type[msgspec.Struct], handler: Any, limit: int = SMALL_BODY_BYTES
    ) -> Response:
        """Read at most `limit` bytes (413 past it), decode, and call handler(body, caller's address)."""
        req_id = None
        try:
            body = await read_json_body(request, limit, kind)
            req_id = getattr(body, "req_id", None)
            result = await handler(body, request.client.host if request.client else None)
        except ApiError as e:  # a SglangError, or the body over `limit` (413) or malformed (400)
            if e.status >= 500:
                logger.error("SGLang %s %s: %d %s", request.url.path, req_id, e.status, e.message)
            return sglang_error_response(e.status, e.message, req_id)
        except Exception as e:  # as SGLang's encoder: any other failure is a 500 naming it
            logger.exception("SGLang %s %s failed", request.url.path, req_id)
            return sglang_error_response(500, f"{type(e).__name__}: {e}", req_id)
        return JSONResponse(result)

    @router.post("/encode")
    async def encode(request: Request) -> Response:
        return await run(request, EncodeRequest, encoder.encode, config.max_body_bytes)

    @router.post("/scheduler_receive_url")
    async def scheduler_receive_url(request: Request) -> Response:
        async def handler(body: ReceiveUrlRequest, caller: str | None) -> None:
            await encoder.register_destination(body, caller)

        return await run(request, ReceiveUrlRequest, handler)

    @router.post("/scheduler_receive_meta_data")
    async def scheduler_receive_meta_data(request: Request) -> Response:
        return await run(request, MetaRequest, encoder.meta)

    @router.post("/send")
    async def send(request: Request) -> Response:
        return await run(request, SendRequest, encoder.send)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if await encoder.health_generate() else 503)

    router.encoder = encoder  # type: ignore[attr-defined]  # for tests and introspection
    return router
