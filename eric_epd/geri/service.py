"""Geri's request path in the router: a checked request turned into one work item, its image slot reserved in the
output pool, the engine's answer awaited, the image read out and its slot freed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from eric_epd.common.errors import ApiError
from eric_epd.geri.body import GenerateRequest
from eric_epd.geri.workload import GeneratorWorkload
from eric_epd.runtime.engine.client import EngineClient, EngineRequest
from eric_epd.transfer.pool import EmbeddingPool, PoolEntry

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    """A request's image slot in the output pool, reserved before its handles are read; `handed` once the engine
    has the request (its answer then frees the slot)."""

    key: str
    entry: PoolEntry
    handed: bool = False


class GenerateService:
    """One image per request; requests of one size and step count batch in the engine."""

    def __init__(self, client: EngineClient, pool: EmbeddingPool, workload: GeneratorWorkload) -> None:
        self._client = client
        self._pool = pool
        self._workload = workload
        self._settling: set[asyncio.Task[np.ndarray]] = set()
        self._admitted = 0
        """Admissions not yet handed to the engine: each will take a place in its queue."""

    @contextlib.contextmanager
    def admitted(self, height: int, width: int) -> Iterator[Admission]:
        """An image slot and a place in the engine's queue, held until `generate` hands the request to the engine
        (or the block fails): a refusal (503: pool or queue full, engine dead) comes before the request's handles
        are read, since a read acknowledges its lease and a retry would then find nothing to read."""
        self._client.check_room(self._admitted + 1)
        key = uuid.uuid4().hex
        entry = self._pool.reserve(key, height * width * 3, (height, width, 3), "uint8")
        if entry is None:
            raise ApiError(503, "image pool full; retry later", retry_after=1.0)
        admission = Admission(key, entry)
        self._admitted += 1
        try:
            yield admission
        finally:
            if not admission.handed:
                self._admitted -= 1
                self._pool.release(key, entry.generation)

    async def generate(self, request: GenerateRequest, admission: Admission) -> np.ndarray:
        """The uint8 [height, width, 3] image, into `admission`'s slot (its pool entry is freed once the engine has
        answered); ApiError with the engine's status otherwise. Cancelling aborts the engine's work."""
        spec, entry = request.spec, admission.entry
        if entry.shape != (spec.height, spec.width, 3):
            raise ApiError(500, f"an image slot of {list(entry.shape)} for an image of {spec.height}x{spec.width}")
        item = self._workload.item(admission.key, spec, entry.offset)
        engine_request = self._client.submit([item], [request.embeddings])  # a refusal: `admitted` frees the slot
        admission.handed = True  # the engine's queue counts it now, and its answer frees the slot
        self._admitted -= 1
        settling = asyncio.create_task(self._settle(engine_request, entry))
        self._settling.add(settling)
        settling.add_done_callback(self._settling.discard)
        timeout = self._client.request_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(settling), timeout)
        except TimeoutError as e:
            self._client.abort(engine_request)
            raise ApiError(504, f"generation timed out after {timeout}s") from e
        except asyncio.CancelledError:
            self._client.abort(engine_request)  # the client left: drop it if it has not started
            raise

    async def _settle(self, request: EngineRequest, entry: PoolEntry) -> np.ndarray:
        """After the engine's final answer (or its death): the image copied out, the slot freed either way."""
        try:
            with self._pool.hold(entry, "engine"):  # the workers write there until the answer
                msg, _ = await request.result
            if msg.error is not None:
                raise ApiError(msg.status, msg.error)
            if [r.key for r in msg.items] != [entry.hash] or tuple(msg.items[0].shape) != entry.shape:
                raise ApiError(500, f"the engine answered {msg.items} for one image of {list(entry.shape)}")
            return self._pool.view(entry).copy().reshape(entry.shape)
        finally:
            self._pool.release(entry.hash, entry.generation)
