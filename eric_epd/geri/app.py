"""The Geri router: FastAPI routes for image generation, health, models and metrics."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.requests import ClientDisconnect

from eric_epd import __version__
from eric_epd.common.disconnect import ClientDisconnectedError, until_disconnect
from eric_epd.common.errors import ApiError, read_json_body
from eric_epd.common.http import ApiKeyMiddleware
from eric_epd.geri.body import check_before_reading, checked_request, checked_sources
from eric_epd.geri.config import GeriConfig
from eric_epd.geri.handles import HandleReader, embeddings_of
from eric_epd.geri.service import GenerateService
from eric_epd.geri.workload import GeneratorWorkload
from eric_epd.runtime.engine.messages import EngineStatusMsg
from eric_epd.runtime.router import EngineWatch, add_status_routes, connected_client, install_error_handlers
from eric_epd.transfer.pool import EmbeddingPool
from eric_epd.wire.geri import GenerateBody

logger = logging.getLogger(__name__)


def png_bytes(image: np.ndarray) -> bytes:
    """A uint8 [height, width, 3] image as PNG (lossless: the pixels read back are the generated ones)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image, "RGB").save(out, format="PNG")
    return out.getvalue()


class GeriMetrics:
    """The Geri's Prometheus series (requests, latency, batches), in its own `registry`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("geri_requests", "/v1/generate requests by HTTP status", ["status"], registry=r)
        self.seconds = Histogram(
            "geri_request_seconds",
            "/v1/generate wall time of answered requests",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.batch_items = Histogram(
            "geri_batch_items", "Images generated per batch", registry=r, buckets=(1, 2, 4, 8, 16, 32)
        )
        self.batch_seconds = Histogram(
            "geri_batch_seconds",
            "Wall time per batch",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )

    def observe_status(self, status: EngineStatusMsg) -> None:
        """Fold an engine status message's finished batches into the batch histograms."""
        for batch in status.batches:
            self.batch_items.observe(batch.num_items)
            self.batch_seconds.observe(batch.seconds)


def create_app(config: GeriConfig, engine: EngineWatch, pool: EmbeddingPool, workload: GeneratorWorkload) -> FastAPI:
    """The router app; its lifespan connects to an engine that is already running."""
    metrics = GeriMetrics()
    model_name = str(config.model)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with connected_client(config, engine.is_alive, metrics.observe_status) as client:
            state["client"] = client
            state["service"] = GenerateService(client, pool, workload)
            state["handles"] = HandleReader(
                config.producer_urls,
                config.producer_api_key,
                config.transfer_backends,
                workload.hidden,
                config.limits.max_prompt_tokens,
            )
            try:
                yield
            finally:
                state["handles"].close()

    app = FastAPI(title="Geri generation server", version=__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/generate")
    async def generate(request: Request) -> Response:
        start = asyncio.get_running_loop().time()
        try:
            raw = checked_sources(await read_json_body(request, config.max_body_bytes, GenerateBody))
            check_before_reading(raw, workload)
            with state["service"].admitted(raw.height, raw.width) as admission:  # refused before any handle is read
                prompt, negative = await embeddings_of(raw, state["handles"])
                checked = checked_request(raw, prompt, negative, workload)
                image = await until_disconnect(request, state["service"].generate(checked, admission))
        except ApiError as e:
            metrics.requests.labels(status=str(e.status)).inc()
            raise
        except (ClientDisconnectedError, ClientDisconnect):
            metrics.requests.labels(status="499").inc()
            return Response(status_code=499)
        png = await asyncio.to_thread(png_bytes, image)
        metrics.requests.labels(status="200").inc()
        metrics.seconds.observe(asyncio.get_running_loop().time() - start)
        return Response(png, media_type="image/png")

    if config.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=config.api_key, open_paths=frozenset({"/health", "/ready", "/metrics"})
        )

    add_status_routes(
        app,
        state,
        engine,
        config,
        {
            "id": model_name,
            "tp_size": config.tp_size,
            "dtype": config.dtype,
            "hidden_size": workload.hidden,
            "size_factor": workload.size_factor,
            "max_side": config.limits.max_side,
            "max_steps": config.limits.max_steps,
        },
    )

    @app.get("/metrics")
    async def prometheus() -> Response:
        if engine.is_alive():
            await state["client"].status(timeout_s=0.5)  # brings the batches run since the last status
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    return app
