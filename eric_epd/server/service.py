"""Encode orchestration in the router: fetch, preprocess, dedupe by content hash, submit, store results."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from eric_epd.engine.client import EngineClient, EngineUnavailableError
from eric_epd.engine.messages import EncodeItem
from eric_epd.server.media import MediaError, MediaFetcher
from eric_epd.server.metrics import EricMetrics
from eric_epd.server.processor import PreparedItem, Processor
from eric_epd.server.store import EmbeddingStore, StoredEmbedding

logger = logging.getLogger(__name__)


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
    embedding: StoredEmbedding


class EncodeService:
    def __init__(self, fetcher: MediaFetcher, processor: Processor, client: EngineClient, store: EmbeddingStore,
                 metrics: EricMetrics) -> None:
        self._fetcher = fetcher
        self._processor = processor
        self._client = client
        self.store = store
        self._metrics = metrics
        self._inflight: dict[str, asyncio.Future[StoredEmbedding]] = {}

    async def encode(self, items: list[ItemRequest]) -> list[ItemAnswer]:
        start = time.perf_counter()
        prepared = await asyncio.gather(*(self._prepare(i, item) for i, item in enumerate(items)))
        embeddings = await self._embed(prepared)
        self._metrics.encode_latency.observe(time.perf_counter() - start)
        return [ItemAnswer(r, p, embeddings[p.hash]) for r, p in zip(items, prepared)]

    async def _prepare(self, index: int, item: ItemRequest) -> PreparedItem:
        try:
            data = await self._fetcher.fetch(item.url)
            return await self._processor.prepare(item.modality, data)
        except MediaError as e:
            raise ApiError(e.status, f"item {index} ({item.id}): {e.message}") from e

    async def _embed(self, prepared: list[PreparedItem]) -> dict[str, StoredEmbedding]:
        """Every distinct hash encoded at most once, across concurrent requests too."""
        found: dict[str, StoredEmbedding] = {}
        waiting: dict[str, asyncio.Future[StoredEmbedding]] = {}
        mine: dict[str, PreparedItem] = {}
        for p in prepared:
            if p.hash in found or p.hash in waiting or p.hash in mine:
                continue
            if (hit := self.store.get(p.hash)) is not None:
                found[p.hash] = hit
                self._metrics.items.labels(modality=p.item.modality, source="cached").inc()
            elif (future := self._inflight.get(p.hash)) is not None:
                waiting[p.hash] = future
            else:
                mine[p.hash] = p
                self._inflight[p.hash] = asyncio.get_running_loop().create_future()
        if mine:
            await self._submit(mine)
        for key, future in waiting.items():
            found[key] = await asyncio.shield(future)
        for key in mine:
            found[key] = self._inflight.pop(key).result()
        return found

    async def _submit(self, mine: dict[str, PreparedItem]) -> None:
        items = [EncodeItem(p.hash, p.item.modality, p.item.grid_thw, *p.item.pixel_values.shape)
                 for p in mine.values()]
        self._metrics.inflight_items.inc(len(items))
        try:
            msg, buffers = await self._client.encode(items, [p.item.pixel_values for p in mine.values()])
            if msg.error is not None:
                raise ApiError(msg.status, msg.error)
        except (EngineUnavailableError, ApiError) as e:
            error = e if isinstance(e, ApiError) else ApiError(e.status, e.message, e.retry_after)
            self._fail(mine, error)
            raise error from e
        except BaseException as e:  # cancelled or unexpected: never leave waiters hanging
            self._fail(mine, ApiError(500, f"encode failed: {e!r}"))
            raise
        finally:
            self._metrics.inflight_items.dec(len(items))
        for result, buf in zip(msg.items, buffers):
            entry = StoredEmbedding(result.hash, tuple(result.shape), result.dtype, bytes(buf))
            self.store.put(entry)
            self._inflight[result.hash].set_result(entry)
            self._metrics.items.labels(modality=mine[result.hash].item.modality, source="encoded").inc()

    def _fail(self, mine: dict[str, PreparedItem], error: ApiError) -> None:
        for key in mine:
            future = self._inflight.pop(key, None)
            if future is not None and not future.done():
                future.set_exception(error)
                future.exception()  # mark retrieved: nobody else may be waiting
