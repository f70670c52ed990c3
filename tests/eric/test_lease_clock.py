"""Leases against the clock, without processes (a real pool, a fake engine, a hand-moved clock): a lease taken early
in a request counts its TTL from the answer; a bridge lease that lapsed under a slow engine ends the request with a
503 and leaves no per-hash state; a popular entry keeps no bookkeeping of ended leases; uploads started in one step
stay within MAX_PUTS; the expiry pass walks only the entries held for consumers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import eric_epd.transfer.pool as pool_module
from eric_epd.common.errors import ApiError
from eric_epd.eric.answers import OutputSpec
from eric_epd.eric.config import EricConfig
from eric_epd.eric.launch import transfer_hub
from eric_epd.eric.metrics import EricMetrics
from eric_epd.eric.service import EncodeService
from eric_epd.transfer.config import TransferConfig
from eric_epd.transfer.global_cache import MAX_PUTS, GlobalCache
from eric_epd.transfer.pool import EmbeddingPool
from tests.support.helpers_engine import FakeEngine, FakeMedia, items, settle

TTL_S = 30.0


class Clock:
    """time.monotonic for the pool, moved by hand."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


class StoreHitting:
    """A global cache stand-in holding "x" only; it takes no uploads."""

    accepting_puts = False
    read_wait_s = 5.0

    async def read_into(self, key: str, region: np.ndarray) -> bool:
        region[:] = 1
        return key == "x"

    def timed_out(self, count: int) -> None:
        pass


def _service(engine: FakeEngine, store: object | None = None) -> EncodeService:
    config = EricConfig(model=Path("."), transfer=TransferConfig(pool_bytes=1 << 20, ttl_s=TTL_S, backends=()))
    media = FakeMedia()
    return EncodeService(media, media, engine, transfer_hub(config), EricMetrics(), OutputSpec(8, "float32"), store)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(pool_module, "time", SimpleNamespace(monotonic=clock))  # the pool's clock only
    return clock


def test_a_lease_taken_early_counts_its_ttl_from_the_answer(clock: Clock) -> None:
    async def run() -> tuple[float, float]:
        engine = FakeEngine()
        service = _service(engine)
        try:
            first = asyncio.create_task(service.encode(items("x")))
            await settle()
            engine.answer(0, [0])
            await first  # its lease on x is still held: x stays in the pool
            request = asyncio.create_task(service.encode(items("x", "y")))  # x is leased at once, y encoded
            await settle()
            clock.now += TTL_S - 1  # the engine takes nearly a TTL over y
            engine.answer(1, [0])
            answers = await request
            entry = service.hub.pool.get("x")
            assert entry is not None
            return entry.lease_expiry[answers[0].handle.lease], clock.now
        finally:
            service.hub.close()

    expiry, answered = asyncio.run(run())
    assert expiry == answered + TTL_S  # not the request's start + TTL: the consumer had one second to ack


def test_a_bridge_lease_lapsed_under_a_slow_engine_ends_the_request_with_a_503_and_no_state_left(clock: Clock) -> None:
    async def run() -> None:
        engine = FakeEngine()
        service = _service(engine, StoreHitting())
        try:
            request = asyncio.create_task(service.encode(items("x", "y")))  # x read from the store, y encoded
            while not engine.requests:
                await asyncio.sleep(0.01)
            clock.now += TTL_S + 1
            service.hub.pool.expire()  # x's bridge lease lapses while the engine works on y
            engine.answer(0, [0])
            with pytest.raises(ApiError) as failed:
                await request
            assert failed.value.status == 503 and "freed before it was answered" in failed.value.message
            inflight = service._inflight
            assert not inflight.wanted or not any(inflight.wanted.values()), inflight.wanted
            assert (inflight.bridges, inflight.futures) == ({}, {})
        finally:
            service.hub.close()

    asyncio.run(run())


def test_a_popular_entry_keeps_no_bookkeeping_of_ended_leases(tmp_path: Path) -> None:
    pool = EmbeddingPool(f"eric_test_clock_{tmp_path.name[-8:]}", 1 << 16, ttl_s=TTL_S)
    try:
        pool.reserve("k", 64, (2, 8), "float32")
        pool.commit("k")
        _, kept = pool.lease("k")  # one lease outlives all the others: the entry never retires
        for _ in range(1000):
            _, token = pool.lease("k")
            children = pool.add_leases("k", token, 2)
            for t in (token, *children):
                assert pool.ack("k", t)
        entry = pool.get("k")
        assert entry is not None and entry.holds(kept)
        assert len(entry.leases) == 1 and len(entry.children) == 0 and len(entry.outstanding) == 1
        pool.add_leases("k", kept, 1)
        assert entry.children == {kept: 1}  # the live root's count is kept, and still bounds it
    finally:
        pool.close()


def test_uploads_started_in_one_step_stay_within_max_puts() -> None:
    cache = GlobalCache.__new__(GlobalCache)  # only the in-flight count: no store is reached
    cache._puts, cache._paused_until = 0, 0.0
    started = []
    while cache.accepting_puts:  # what the service checks before each upload, with no await in between
        started.append(cache.write("k", np.zeros(4, np.uint8)))
    assert len(started) == MAX_PUTS
    for coroutine in started:
        coroutine.close()


def test_the_expiry_pass_looks_only_at_entries_held_for_consumers(tmp_path: Path) -> None:
    pool = EmbeddingPool(f"eric_test_cache_{tmp_path.name[-8:]}", 1 << 20, ttl_s=TTL_S, keep_acked_bytes=1 << 20)
    try:
        for i in range(1000):  # a content cache of acknowledged entries
            key = f"c{i}"
            pool.reserve(key, 64, (2, 8), "float32")
            pool.commit(key)
            assert pool.ack(key, pool.lease(key)[1])
        for key in ("a", "b", "c"):  # and three leased
            pool.reserve(key, 64, (2, 8), "float32")
            pool.commit(key)
            pool.lease(key)
        assert sorted(pool._held) == ["a", "b", "c"]  # what the pass walks: not the thousand cached
        assert sorted(pool.expire(time.monotonic() + TTL_S + 1)) == ["a", "b", "c"]
        assert pool.cached_bytes == 1000 * 256 and pool.audit() is None  # the cache is untouched
    finally:
        pool.close()
