"""A client that disconnects cancels its work, without processes: the engine drops an aborted request's queued
items and answers it once; EncodeService keeps what a live request waits for, frees space once the engine answered."""

from __future__ import annotations

import asyncio

import pytest

from eric_epd.common.errors import ApiError
from eric_epd.eric.config import BatchLimits
from eric_epd.runtime.engine.engine import ABORTED_STATUS, Engine
from eric_epd.runtime.engine.messages import AbortRequestMsg
from eric_epd.runtime.work import Batch
from tests.support.helpers_engine import WORKLOAD as _WORKLOAD
from tests.support.helpers_engine import FakeEngine as _FakeEngine
from tests.support.helpers_engine import InstantExecutor
from tests.support.helpers_engine import encode_service as _service
from tests.support.helpers_engine import items as _items
from tests.support.helpers_engine import settle as _settle
from tests.support.helpers_engine import work_request as _request

# ---------------------------------------------------------------- engine protocol (no processes)


class _FakeExecutor(InstantExecutor):
    """Runs every batch instantly; records which item hashes ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def submit(self, batch: Batch) -> None:
        self.ran += [e.item.key for e in batch.entries]


def _engine(limits: BatchLimits, executor: _FakeExecutor) -> Engine:
    return Engine(limits, executor, _WORKLOAD.validate)


def test_engine_abort_drops_queued_items_and_answers_once() -> None:
    executor = _FakeExecutor()
    engine = _engine(BatchLimits(max_items=1, max_patches=4096), executor)
    assert engine.add_request(*_request("a", ["a0", "a1", "a2"])) == []
    assert engine.add_request(*_request("b", ["b0"])) == []
    assert engine.step() == []  # a0 ran
    assert engine.abort(AbortRequestMsg("a", [1])) == []  # a2 is still queued: no answer yet
    [(aborted, _)] = engine.step()  # a2 ran, a1 was dropped: a is over
    assert aborted.request_id == "a" and aborted.status == ABORTED_STATUS and "1 of 3" in aborted.error
    assert [r.key for r in aborted.items] == ["a0", "a2"]  # finished anyway: written, so the router commits them
    assert engine.abort(AbortRequestMsg("a")) == []  # answered once; later aborts are ignored
    [(answer, _)] = engine.step()
    assert answer.request_id == "b" and answer.error is None and [r.key for r in answer.items] == ["b0"]
    assert executor.ran == ["a0", "a2", "b0"]
    status = engine.status()
    assert status.queued_items == 0 and status.running_items == 0


def test_engine_abort_of_a_whole_queued_request() -> None:
    engine = _engine(BatchLimits(max_items=8, max_patches=4096), _FakeExecutor())
    engine.add_request(*_request("a", ["a0", "a1"]))
    [(answer, _)] = engine.abort(AbortRequestMsg("a"))
    assert answer.status == ABORTED_STATUS and answer.items == []
    assert engine.step() == [] and not engine.has_work


# ---------------------------------------------------------------- EncodeService (fake engine, real pool)


def test_service_timeout_keeps_space_until_the_engine_answers() -> None:
    async def run() -> None:
        engine = _FakeEngine()
        engine.request_timeout_s = 0.2
        with _service(engine) as service:
            with pytest.raises(ApiError) as timed_out:
                await service.encode(_items("x", "y"))
            assert timed_out.value.status == 504
            assert engine.aborts == [("r0", [0, 1])]
            assert len(service.hub.pool) == 2  # the workers may still write there
            engine.answer(0, [0], status=ABORTED_STATUS)  # x ran anyway, y was dropped
            await _settle()
            assert len(service.hub.pool) == 0 and service.hub.pool.used_bytes == 0

    asyncio.run(run())


def test_service_cancel_keeps_what_a_live_request_waits_for() -> None:
    async def run() -> None:
        engine = _FakeEngine()
        with _service(engine) as service:
            owner = asyncio.create_task(service.encode(_items("x", "y")))
            await _settle()
            waiter = asyncio.create_task(service.encode(_items("x")))
            await _settle()
            owner.cancel()  # its client left
            await _settle()
            assert owner.cancelled() and engine.aborts == [("r0", [1])]  # x stays: the waiter wants it
            engine.answer(0, [0], status=ABORTED_STATUS)
            [answer] = await waiter
            assert answer.handle.hash == "x"
            assert len(service.hub.pool) == 1  # y freed; x held by the waiter's lease only
            assert service.hub.ack("x", answer.handle.lease)[0] == 200
            assert len(service.hub.pool) == 0 and service.hub.pool.used_bytes == 0
            assert len(engine.requests) == 1  # x was encoded once

    asyncio.run(run())


def test_service_cancel_of_every_requester_aborts_and_gives_back() -> None:
    async def run() -> None:
        engine = _FakeEngine()
        with _service(engine) as service:
            cached = asyncio.create_task(service.encode(_items("c")))
            await _settle()
            engine.answer(0, [0])
            [c] = await cached
            owner = asyncio.create_task(service.encode(_items("c", "x")))  # leases c at once, then encodes x
            await _settle()
            waiter = asyncio.create_task(service.encode(_items("x")))
            await _settle()
            owner.cancel()
            await _settle()
            assert engine.aborts == []  # the waiter still wants x
            waiter.cancel()
            await _settle()
            assert engine.aborts == [("r1", [0])]
            engine.answer(1, [], status=ABORTED_STATUS)
            await _settle()
            # the first lease on c is intact, and once it ends the pool is empty: the owner gave back its own
            assert service.hub.ack("c", c.handle.lease)[0] == 200
            assert len(service.hub.pool) == 0 and service.hub.pool.used_bytes == 0

    asyncio.run(run())
