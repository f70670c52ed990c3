"""Encode orchestration in the router: fetch, preprocess, dedupe by content hash, reserve pool space, submit, lease."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from eric_epd.engine.client import EngineClient, EngineUnavailableError
from eric_epd.engine.messages import EncodeItem
from eric_epd.server.media import MediaError, MediaFetcher
from eric_epd.server.metrics import EricMetrics
from eric_epd.server.processor import PreparedItem, Processor
from eric_epd.transfer.handles import EmbeddingHandle
from eric_epd.transfer.pool import PoolEntry
from eric_epd.transfer.producer import PoolFullError, TransferHub

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ApiError(Exception):
    """An error answered to the client as {"error": {...}} with this HTTP status."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class ItemRequest:
    id: str
    modality: str
    url: str


@dataclass(frozen=True)
class ItemAnswer:
    request: ItemRequest
    prepared: PreparedItem
    handle: EmbeddingHandle


@dataclass(frozen=True)
class OutputSpec:
    """What the encoder emits per merged token."""

    dim: int
    dtype: str

    def nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.dim * _DTYPE_BYTES[self.dtype]


class EncodeService:
    def __init__(self, fetcher: MediaFetcher, processor: Processor, client: EngineClient, hub: TransferHub,
                 metrics: EricMetrics, output: OutputSpec) -> None:
        self._fetcher = fetcher
        self._processor = processor
        self._client = client
        self.hub = hub
        self._metrics = metrics
        self._output = output
        self._inflight: dict[str, asyncio.Future[None]] = {}

    async def encode(self, items: list[ItemRequest]) -> list[ItemAnswer]:
        start = time.perf_counter()
        prepared = await asyncio.gather(*(self._prepare(i, item) for i, item in enumerate(items)))
        handles = await self._embed(prepared)
        self._metrics.encode_latency.observe(time.perf_counter() - start)
        return [ItemAnswer(r, p, handles[p.hash]) for r, p in zip(items, prepared)]

    async def _prepare(self, index: int, item: ItemRequest) -> PreparedItem:
        try:
            data = await self._fetcher.fetch(item.url)
            return await self._processor.prepare(item.modality, data)
        except MediaError as e:
            raise ApiError(e.status, f"item {index} ({item.id}): {e.message}") from e

    async def _embed(self, prepared: list[PreparedItem]) -> dict[str, EmbeddingHandle]:
        """One lease per distinct hash; every hash encoded at most once at a time, across requests too."""
        distinct = {p.hash: p for p in prepared}
        handles: dict[str, EmbeddingHandle] = {}
        for _attempt in range(3):  # an entry may be freed between another request's commit and our lease
            waiting: list[asyncio.Future[None]] = []
            mine: dict[str, PreparedItem] = {}
            for key, p in distinct.items():
                if key in handles:
                    continue
                entry = self.hub.pool.get(key)
                if entry is not None and entry.ready:
                    handles[key] = self.hub.handle(self.hub.pool.lease(key))
                    self._metrics.items.labels(modality=p.item.modality, source="cached").inc()
                elif key in self._inflight:
                    waiting.append(self._inflight[key])
                else:
                    mine[key] = p
            if mine:
                handles.update(await self._submit(mine))
            if not waiting:
                return handles
            await asyncio.gather(*(asyncio.shield(f) for f in waiting))
        raise ApiError(503, "embeddings were freed while this request waited for them; retry", retry_after=1.0)

    async def _submit(self, mine: dict[str, PreparedItem]) -> dict[str, EmbeddingHandle]:
        loop = asyncio.get_running_loop()
        for key in mine:
            self._inflight[key] = loop.create_future()
        entries: list[PoolEntry] = []
        try:
            for key, p in mine.items():
                entries.append(await self.hub.reserve(key, self._output.nbytes(p.item.num_tokens),
                                                      (p.item.num_tokens, self._output.dim), self._output.dtype))
            await self._run(mine, entries)
        except BaseException as e:
            for entry in entries:
                self.hub.release(entry.hash)
            self._finish(mine, e)
            if isinstance(e, PoolFullError):
                raise ApiError(503, str(e), retry_after=1.0) from e
            if isinstance(e, EngineUnavailableError):
                raise ApiError(e.status, e.message, e.retry_after) from e
            raise
        handles = {}
        for entry in entries:
            self.hub.pool.commit(entry.hash)
            handles[entry.hash] = self.hub.handle(self.hub.pool.lease(entry.hash))
            self._metrics.items.labels(modality=mine[entry.hash].item.modality, source="encoded").inc()
        self._finish(mine, None)
        return handles

    async def _run(self, mine: dict[str, PreparedItem], entries: list[PoolEntry]) -> None:
        items = [EncodeItem(p.hash, p.item.modality, p.item.grid_thw, *p.item.pixel_values.shape, e.offset, e.nbytes)
                 for p, e in zip(mine.values(), entries)]
        self._metrics.inflight_items.inc(len(items))
        try:
            msg, _ = await self._client.encode(items, [np.asarray(p.item.pixel_values) for p in mine.values()])
        finally:
            self._metrics.inflight_items.dec(len(items))
        if msg.error is not None:
            raise ApiError(msg.status, msg.error)
        for result, entry in zip(msg.items, entries):
            if tuple(result.shape) != entry.shape or result.dtype != entry.dtype:
                raise ApiError(500, f"encoder produced {result.shape} {result.dtype}, "
                                    f"expected {entry.shape} {entry.dtype}")

    def _finish(self, mine: dict[str, PreparedItem], error: BaseException | None) -> None:
        """Wake requests waiting on these hashes (they re-check the pool, so an error needs no propagation)."""
        for key in mine:
            future = self._inflight.pop(key, None)
            if future is not None and not future.done():
                future.set_result(None)
        if error is not None and not isinstance(error, ApiError | PoolFullError | EngineUnavailableError):
            logger.warning("encode of %d items failed: %r", len(mine), error)
