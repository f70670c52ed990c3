"""The Eric router: FastAPI routes for encode, embedding fetch, health, models and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from eric_epd import __version__
from eric_epd.common.disconnect import ClientDisconnectedError, until_disconnect
from eric_epd.common.dns import address_url
from eric_epd.common.errors import OFF_LOOP_BYTES, ApiError, read_body
from eric_epd.common.http import ApiKeyMiddleware
from eric_epd.common.registration import MEMBER_PROOF_PATH, NONCE_HEX, MemberProof, member_proof
from eric_epd.eric.alias import RawAlias
from eric_epd.eric.answers import ItemAnswer, OutputSpec, RequestClock
from eric_epd.eric.config import EricConfig
from eric_epd.eric.encode_body import parse_encode_body
from eric_epd.eric.membership import GatewayMembership
from eric_epd.eric.metrics import EricMetrics
from eric_epd.eric.openapi import eric_openapi
from eric_epd.eric.processor import Processor, model_fingerprint, tower_precision
from eric_epd.eric.service import EncodeService
from eric_epd.eric.sglang.protocol import sglang_error_response
from eric_epd.eric.sglang.routes import sglang_routes
from eric_epd.eric.sglang.video import QWEN_VL_TYPES
from eric_epd.media.fetch import MediaFetcher
from eric_epd.models.facts import ModelFacts
from eric_epd.models.registry import load_processor
from eric_epd.runtime.router import EngineWatch, add_status_routes, connected_client, install_error_handlers
from eric_epd.transfer.global_cache import GlobalCache
from eric_epd.transfer.pool import EmbeddingPool
from eric_epd.transfer.producer import TransferHub
from eric_epd.transfer.routes import transfer_routes
from eric_epd.wire.eric import EncodeAnswer, EncodedItem, Placement

logger = logging.getLogger(__name__)


def member_proof_answer(key: str | None, request: Request) -> Response:
    """The MemberProof for `request`'s nonce at the local address its connection reached; 404 without a key."""
    if key is None:
        raise ApiError(404, "this Eric has no key to prove")
    nonce, server = request.query_params.get("nonce", ""), request.scope.get("server")
    if not NONCE_HEX.fullmatch(nonce):
        raise ApiError(400, "nonce must be 32 to 128 lowercase hex digits", param="nonce")
    if not server or server[1] is None:
        raise ApiError(400, "this connection has no local address to prove")
    return Response(
        msgspec.json.encode(MemberProof(member_proof(key, nonce, address_url(server[0], server[1])))),
        media_type="application/json",
    )


def encoded_item(answer: ItemAnswer, placement: Placement) -> EncodedItem:
    """The wire form of one answered item (and of its soundtrack), placed by the engine as `placement` says
    (ModelFacts.placement)."""
    handle, item = answer.handle, answer.prepared.item
    return EncodedItem(
        id=answer.request.id,
        modality=answer.request.modality,
        hash=handle.hash,
        shape=list(handle.shape),
        dtype=handle.dtype,
        num_tokens=item.num_tokens,
        grid_thw=list(item.grid_thw),
        handle=handle,
        second_per_grid_ts=item.second_per_grid_ts,
        timestamps=list(item.timestamps) if item.timestamps is not None else None,
        placement=placement,
        soundtrack=encoded_item(answer.soundtrack, placement) if answer.soundtrack is not None else None,
    )


async def drain_leases(service: EncodeService, pool: EmbeddingPool, timeout_s: float) -> None:
    """Wait until no encode is in progress and no lease handed out is left (each acknowledged, given back or
    lapsed), or `timeout_s`: consumers read and acknowledge them meanwhile, as the listener stays open."""
    logger.info("draining: %d pool entries held by consumers; waiting up to %gs", len(pool), timeout_s)
    deadline = time.monotonic() + timeout_s
    while not (service.idle and len(pool) == 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if service.idle and len(pool) == 0:
        logger.info("drained: every lease handed out has ended")
    else:
        logger.warning("drain timed out: %d pool entries still held", len(pool))


def create_app(config: EricConfig, facts: ModelFacts, engine: EngineWatch, hub: TransferHub) -> FastAPI:
    """The router app for the checkpoint `facts` describe (read once by the caller); its lifespan connects to an
    engine that is already running and serves `hub`'s pool."""
    metrics = EricMetrics()
    mp = load_processor(facts.model_dir, facts.config)
    # width and dtype of the encoder's output, known before any batch runs (to reserve pool space)
    spec = OutputSpec(facts.embedding_width, facts.output_dtype(config.dtype), facts.widths)
    model_name = str(config.model)
    placement = facts.placement
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        fetcher = MediaFetcher(config.url_policy, config.media)
        sglang_video = config.sglang.video if facts.model_type in QWEN_VL_TYPES else None
        precision = tower_precision(config.compute_dtype, config.dtype, config.resolved_device(), facts)
        model_id = model_fingerprint(facts, precision)
        processor = Processor(mp, config.media, config.preprocess_pool_size(), model_id, sglang_video)
        expiry = asyncio.create_task(hub.expiry_loop())
        membership = GatewayMembership(
            config.register_with, config.register_key, config.public_url, config.heartbeat_s, config.api_key
        )
        shared = (
            GlobalCache(
                config.global_cache,
                config.transfer.advertise_host,
                config.global_cache_bytes,
                hub.pool.array,
                spec.dtype,
            )
            if config.global_cache
            else None
        )
        metrics.global_cache, metrics.pool = shared, hub.pool
        if shared is not None:
            shared.start()
        try:
            async with connected_client(config, engine.is_alive, metrics.observe_status) as client:
                state["client"] = client
                alias = RawAlias(config.alias_entries, processor.salts) if config.alias_entries else None
                state["service"] = EncodeService(
                    fetcher, processor, client, hub, metrics, spec, shared, config.batch.max_queued_items, alias
                )
                heartbeat = asyncio.create_task(membership.run()) if config.register_with else None

                async def leave_gateways() -> None:
                    if heartbeat is not None:
                        heartbeat.cancel()
                        await asyncio.gather(heartbeat, return_exceptions=True)  # no registration after leaving
                        await membership.leave()

                async def drain() -> None:
                    # leave first, still admitting: work a gateway sent before it heard is served, not refused
                    await leave_gateways()
                    state["service"].stop_admitting()
                    await drain_leases(state["service"], hub.pool, config.drain_timeout_s)

                app.state.before_drain = drain  # the server calls it while it still listens, then stops listening
                try:
                    yield
                finally:  # already done unless the server skipped its hook
                    await leave_gateways()
        finally:
            expiry.cancel()
            if shared is not None:
                shared.close()
            await fetcher.aclose()
            processor.close()

    app = FastAPI(title="Eric encode server", version=__version__, lifespan=lifespan)
    schema = eric_openapi(__version__, list(facts.modalities), config.max_items_per_request)
    app.openapi = lambda: schema  # type: ignore[method-assign]  # written out: the routes read raw bodies

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        clock = RequestClock()
        try:
            body = await read_body(request, config.max_body_bytes)
            metrics.stages.observe("body_read", time.perf_counter() - clock.start)
            parse = (parse_encode_body, body, facts.modalities, config.max_items_per_request)
            items = parse[0](*parse[1:]) if len(body) <= OFF_LOOP_BYTES else await asyncio.to_thread(*parse)
            # a client that leaves cancels its work: queued items are dropped, its leases given back
            answers = await until_disconnect(request, state["service"].encode(items, clock))
        except ApiError as e:
            metrics.requests.labels(status=str(e.status)).inc()
            raise
        except (ClientDisconnectedError, ClientDisconnect):  # after the body was read, or while it was
            metrics.requests.labels(status="499").inc()
            logger.info("client left POST /v1/encode: its work was cancelled")
            return Response(status_code=499)
        metrics.requests.labels(status="200").inc()
        start = time.perf_counter()
        answer = EncodeAnswer(model_name, [encoded_item(a, placement) for a in answers])
        response = Response(msgspec.json.encode(answer), media_type="application/json")
        done = time.perf_counter()
        metrics.stages.observe("answer", done - start)
        metrics.overhead.observe(max(0.0, done - clock.start - clock.compute_seconds))
        return response

    app.include_router(transfer_routes(hub))
    sglang = sglang_routes(config, facts, spec, hub, state)  # SGLang encoder protocol (/encode, /send, ...)
    app.include_router(sglang)
    sglang_paths = frozenset(r.path for r in sglang.routes)
    metrics.sglang_state = getattr(getattr(sglang, "encoder", None), "state", None)

    install_error_handlers(
        app,
        lambda request, message: (
            sglang_error_response(500, message, None) if request.url.path in sglang_paths else None
        ),
    )
    if config.api_key:
        # SGLang's receivers send no headers: its routes are bounded by the caller's address and the peer allowlist
        open_paths = frozenset({"/health", "/ready", "/metrics", MEMBER_PROOF_PATH, *(r.path for r in sglang.routes)})
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=open_paths)

    add_status_routes(
        app,
        state,
        engine,
        config,
        {
            "id": model_name,
            "modalities": list(facts.modalities),
            "tp_size": config.tp_size,
            "dtype": config.dtype,
            "placement": placement,
            "takes_audio": facts.takes_audio,
        },
        lambda: state["service"].room(),
    )

    @app.get(MEMBER_PROOF_PATH)
    async def prove_membership(request: Request) -> Response:
        """A gateway's challenge (?nonce=HEX), answered with an HMAC under this Eric's key of the nonce and the
        address this connection reached: proof that it holds the key, which a relay cannot reuse."""
        return member_proof_answer(config.api_key, request)

    @app.get("/v1/load")
    async def load() -> Response:
        """Queue depth, busy fraction, items/s and p99 encode latency over the last 30 s (for the gateway and an
        autoscaler)."""
        if engine.is_alive():
            await state["client"].status(timeout_s=0.5)  # brings the batches run since the last status
        return Response(msgspec.json.encode(metrics.load.report()), media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        if engine.is_alive():
            await state["client"].status(timeout_s=0.5)  # refreshes queue depth and batch counts
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
