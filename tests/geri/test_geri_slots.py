"""Geri's image slot goes back on every failure to hand the work to the engine, not only when the engine is down:
the real GenerateService and pool, with stand-ins for the engine client (no engine process is needed to refuse)."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from eric_epd.geri.body import GenerateRequest
from eric_epd.geri.limits import GenerateSpec
from eric_epd.geri.service import GenerateService
from eric_epd.runtime.engine.client import EngineUnavailableError
from eric_epd.testing.pools import assert_pool_empty
from eric_epd.transfer.pool import EmbeddingPool


class SubmitRaises:
    """A stand-in engine client whose submit raises `error` (the engine never sees the request)."""

    request_timeout_s = 5.0

    def __init__(self, error: BaseException) -> None:
        self.error = error

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
        with pytest.raises(type(error)):
            asyncio.run(service.generate(GenerateRequest(spec, np.zeros((2, 4), np.float32))))
        assert_pool_empty(pool)
    finally:
        pool.close()
