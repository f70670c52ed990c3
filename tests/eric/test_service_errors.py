"""EncodeService's failures without processes (fake engine, real pool): a submit that fails for any reason frees its
space and leaves the content encodable; a request that cannot fit the whole pool is a 413 at once; requests that
must wait for space hold none of it meanwhile; past --max-queued-items items accepted, a request is refused before
anything of it is fetched."""

from __future__ import annotations

import asyncio

import pytest

from eric_epd.common.errors import ApiError
from eric_epd.runtime.engine.client import EngineRequest
from eric_epd.runtime.work import WorkItem
from eric_epd.testing.pools import assert_pool_empty
from eric_epd.transfer.free_list import span
from eric_epd.transfer.producer import Want
from tests.support.helpers_engine import FakeEngine, encode_service, items, settle

ITEM_BYTES = span(4 * 8 * 4)  # FakeMedia's items: 4 rows of 8 float32 values
POOL_ITEMS = 16  # the smallest pool (4096 bytes) holds 16 of them


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


class _FailsOnce(FakeEngine):
    """Its first submit raises what no engine client is meant to (a bug, a MemoryError)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def submit(self, work: list[WorkItem], inputs: list) -> EngineRequest:
        if not self.failed:
            self.failed = True
            raise ValueError("injected")
        return super().submit(work, inputs)


def test_a_submit_failing_unexpectedly_frees_its_space_and_the_content_stays_encodable() -> None:
    async def run() -> None:
        engine = _FailsOnce()
        with encode_service(engine) as service:
            with pytest.raises(ValueError):
                await service.encode(items("x", "y"))
            assert len(service.hub.pool) == 0 and service.hub.pool.used_bytes == 0
            again = asyncio.create_task(service.encode(items("x")))  # not stuck behind the failed attempt
            await settle()
            assert [w.key for w in engine.requests[0][1]] == ["x"]
            engine.answer(0, [0])
            [x] = await asyncio.wait_for(again, 5)
            assert service.hub.ack("x", x.handle.lease)[0] == 200
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_request_larger_than_the_whole_pool_is_a_413_naming_the_pool() -> None:
    async def run() -> None:
        engine = FakeEngine()
        with encode_service(engine, pool_bytes=POOL_ITEMS * ITEM_BYTES) as service:
            with pytest.raises(ApiError) as refused:
                await service.encode(items(*_names("a", POOL_ITEMS + 1)))
            assert refused.value.status == 413 and "--pool-bytes" in str(refused.value)
            assert engine.requests == [] and service.hub.pool.used_bytes == 0
            done = asyncio.create_task(service.encode(items(*_names("a", POOL_ITEMS))))  # a full pool still fits
            await settle()
            engine.answer(0, list(range(POOL_ITEMS)))
            answers = await asyncio.wait_for(done, 5)
            assert [a.handle.hash for a in answers] == _names("a", POOL_ITEMS)

    asyncio.run(run())


def test_a_request_waiting_for_space_holds_none_of_it() -> None:
    """Two requests of 12 items into a pool of 16: the second waits with nothing reserved (the 4 free items' space
    stays free for others), then fits once the first's leases end."""

    async def run() -> None:
        engine = FakeEngine()
        with encode_service(engine, pool_bytes=POOL_ITEMS * ITEM_BYTES) as service:
            first = asyncio.create_task(service.encode(items(*_names("a", 12))))
            await settle()
            second = asyncio.create_task(service.encode(items(*_names("b", 12))))
            await settle()
            assert len(engine.requests) == 1 and service.hub.pool.used_bytes == 12 * ITEM_BYTES
            others = await service.hub.reserve_all([Want(k, ITEM_BYTES, (4, 8), "float32") for k in _names("c", 4)])
            for entry in others:
                service.hub.release(entry)
            engine.answer(0, list(range(12)))
            for answer in await first:
                assert service.hub.ack(answer.handle.hash, answer.handle.lease)[0] == 200
            await settle()
            assert [w.key for w in engine.requests[1][1]] == _names("b", 12)
            engine.answer(1, list(range(12)))
            assert [a.handle.hash for a in await asyncio.wait_for(second, 5)] == _names("b", 12)

    asyncio.run(run())


def test_items_past_the_limit_are_refused_before_anything_is_fetched() -> None:
    async def run() -> None:
        engine = FakeEngine()
        with encode_service(engine, max_items=4) as service:
            with pytest.raises(ApiError) as too_many:
                await service.encode(items(*_names("a", 5)))
            assert too_many.value.status == 413 and "--max-queued-items" in str(too_many.value)
            first = asyncio.create_task(service.encode(items(*_names("b", 3))))
            await settle()
            with pytest.raises(ApiError) as busy:
                await service.encode(items("c0", "c1"))
            assert busy.value.status == 503 and "queue full" in str(busy.value) and busy.value.retry_after == 1.0
            assert len(engine.requests) == 1 and service.hub.pool.get("c0") is None
            fits = asyncio.create_task(service.encode(items("b0")))  # 4 items accepted: still within the limit
            await settle()
            engine.answer(0, [0, 1, 2])
            await asyncio.wait_for(asyncio.gather(first, fits), 5)
            second = asyncio.create_task(service.encode(items("c0", "c1")))  # answered: room again
            await settle()
            assert [w.key for w in engine.requests[1][1]] == ["c0", "c1"]
            engine.answer(1, [0, 1])
            assert [a.handle.hash for a in await asyncio.wait_for(second, 5)] == ["c0", "c1"]

    asyncio.run(run())
