"""Geri's image slot goes back on every failure to hand the work to the engine, not only when the engine is down; a
request is admitted (slot and queue place) before its handles are read, and admissions count against the engine's
queue: the real GenerateService, pool and EngineClient (its sockets connect to no engine: none is needed to refuse),
with a stand-in client whose submit raises."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import numpy as np
import pytest

from eric_epd.geri.body import GenerateRequest
from eric_epd.geri.limits import GenerateSpec
from eric_epd.geri.service import GenerateService
from eric_epd.runtime.config import BatchLimits, RuntimeConfig
from eric_epd.runtime.engine.client import EngineClient, EngineUnavailableError
from eric_epd.testing.pools import assert_pool_empty
from eric_epd.transfer.pool import EmbeddingPool


class SubmitRaises:
    """A stand-in engine client whose submit raises `error` (the engine never sees the request)."""

    request_timeout_s = 5.0

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def check_room(self, count: int) -> None:
        pass

    def submit(self, items: object, inputs: object) -> None:
        raise self.error


class ItemOnly:
    """A stand-in workload: builds the work item only."""

    def item(self, key: str, spec: GenerateSpec, offset: int) -> tuple[str, int]:
        return key, offset


@pytest.mark.parametrize(
    "error",
    [EngineUnavailableError(503, "engine queue full"), RuntimeError("encode failed"), MemoryError()],
    ids=["unavailable", "other", "memory"],
)
def test_a_refused_submit_frees_the_slot(error: BaseException) -> None:
    pool = EmbeddingPool(f"geri-test-{uuid.uuid4().hex[:8]}", 1 << 20, ttl_s=60)
    try:
        service = GenerateService(SubmitRaises(error), pool, ItemOnly())  # type: ignore[arg-type]
        spec = GenerateSpec(16, 16, 1, 0, 1.0, 2, 0, 4)
        with pytest.raises(type(error)), service.admitted(16, 16) as admission:
            asyncio.run(service.generate(GenerateRequest(spec, np.zeros((2, 4), np.float32)), admission))
        assert_pool_empty(pool)
    finally:
        pool.close()


def test_admissions_take_the_engines_queue_places_before_any_handle_is_read(tmp_path: Path) -> None:
    """With a queue of 2, two admitted requests (reading their handles) leave no place for a third, which is refused
    with 503 before it reads anything; a failed admission frees its slot and its place."""
    config = RuntimeConfig(model=tmp_path, run_dir=tmp_path, batch=BatchLimits(max_queued_items=2))
    pool = EmbeddingPool(f"geri-test-{uuid.uuid4().hex[:8]}", 1 << 20, ttl_s=60)
    client = EngineClient(config, lambda: True)
    try:
        service = GenerateService(client, pool, ItemOnly())
        with service.admitted(16, 16), service.admitted(16, 16):
            with pytest.raises(EngineUnavailableError, match="queue full") as refused, service.admitted(16, 16):
                pass
            assert refused.value.status == 503 and len(pool) == 2
        assert_pool_empty(pool)
        with pytest.raises(KeyError), service.admitted(16, 16):
            raise KeyError("a handle's read failed")
        assert_pool_empty(pool)
        with service.admitted(16, 16), service.admitted(16, 16):
            pass  # both places are free again
    finally:
        asyncio.run(client.close())
        pool.close()
