"""A hung global-cache store isolated from the rest of Eric: the real GlobalCache with a stand-in for Mooncake Store's
client whose calls block (the store's master stopped answering). Its calls run on the cache's own few threads, so the
default thread pool (media DNS, decoding) stays free; once one call fails, those queued behind it are skipped instead
of each waiting out the store's timeout; puts in flight are capped and fresh embeddings past the cap are not shared."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from eric_epd.transfer import global_cache
from eric_epd.transfer.global_cache import MAX_PUTS, STORE_THREADS, GlobalCache

HANG_S = 1.0


class HungStore:
    """A stand-in store client: every call blocks HANG_S, then fails (rc -1), as a store whose master is gone."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def _hang(self) -> int:
        with self._lock:
            self.calls += 1
        time.sleep(HANG_S)
        return -1

    def get_into(self, key: str, address: int, nbytes: int) -> int:
        return self._hang()

    def put_from(self, key: str, address: int, nbytes: int) -> int:
        return self._hang()

    def close(self) -> None:
        pass


def _cache(pool: np.ndarray) -> tuple[GlobalCache, HungStore]:
    cache = GlobalCache("127.0.0.1:1", "127.0.0.1", 1 << 20, pool, "float32")
    store = HungStore()
    cache._store = store  # joined: the store answered once, then hung
    return cache, store


def test_a_hung_store_leaves_the_default_pool_free_and_skips_queued_calls() -> None:
    async def run() -> None:
        pool = np.zeros(1 << 16, np.uint8)
        cache, store = _cache(pool)
        try:
            reads = [
                asyncio.ensure_future(cache.read_into(f"{i:064x}", pool[i * 64 : (i + 1) * 64])) for i in range(48)
            ]
            await asyncio.sleep(0.1)
            started = time.monotonic()
            assert await asyncio.to_thread(lambda: 7) == 7  # the default pool is not queued behind the store
            assert time.monotonic() - started < HANG_S / 2
            assert not any(await asyncio.gather(*reads))  # misses, none an error to the request
            # the first calls failed and paused the store: the ones queued behind them never ran
            assert store.calls == STORE_THREADS and cache.stats.errors >= 1
        finally:
            cache.close()

    asyncio.run(run())


def test_puts_in_flight_are_capped() -> None:
    async def run() -> None:
        pool = np.zeros(1 << 16, np.uint8)
        cache, _ = _cache(pool)
        try:
            assert cache.accepting_puts
            puts = []
            for i in range(3 * MAX_PUTS):
                if cache.accepting_puts:
                    puts.append(asyncio.ensure_future(cache.write(f"{i:064x}", pool[:64])))
                    await asyncio.sleep(0)  # the put starts (counted) before the next is considered
            assert len(puts) == MAX_PUTS and not cache.accepting_puts
            await asyncio.gather(*puts)
            assert not cache.accepting_puts  # they failed: the store is paused ...
            cache._paused_until = 0.0  # ... until the pause ends (PAUSE_AFTER_ERROR_S)
            assert cache.accepting_puts
        finally:
            cache.close()

    asyncio.run(run())


def test_the_pause_is_what_skips_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with no pause after an error, every queued call runs and waits out the hang."""
    monkeypatch.setattr(global_cache, "PAUSE_AFTER_ERROR_S", 0.0)

    async def run() -> None:
        pool = np.zeros(1 << 16, np.uint8)
        cache, store = _cache(pool)
        try:
            await asyncio.gather(*(cache.read_into(f"{i:064x}", pool[:64]) for i in range(2 * STORE_THREADS)))
            assert store.calls == 2 * STORE_THREADS
        finally:
            cache.close()

    asyncio.run(run())


class AnsweringStore:
    """A stand-in store client that answers every call with `rc` at once (Mooncake Store's codes, types.h)."""

    def __init__(self, rc: int) -> None:
        self.rc = rc

    def get_into(self, key: str, address: int, nbytes: int) -> int:
        return self.rc

    def put_from(self, key: str, address: int, nbytes: int) -> int:
        return self.rc

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "rc, pauses",
    [(-704, False), (-703, False), (-705, False), (-200, False), (-900, True), (-1, True)],
    ids=["not-found", "replica-not-ready", "already-exists", "store-full", "rpc-fail", "raised"],
)
def test_only_a_failing_store_pauses_the_cache(rc: int, pauses: bool) -> None:
    """A key not found, a replica another Eric is still putting, a key already put, a store at its high watermark:
    the store works, so a read misses (or a put is skipped) and the next call goes to it; an RPC failure pauses it."""

    async def run() -> None:
        pool = np.zeros(1 << 16, np.uint8)
        cache = GlobalCache("127.0.0.1:1", "127.0.0.1", 1 << 20, pool, "float32")
        cache._store = AnsweringStore(rc)
        try:
            assert not await cache.read_into("a" * 64, pool[:64])
            await cache.write("b" * 64, pool[:64])
            assert cache.accepting_puts is not pauses and (cache.stats.errors > 0) is pauses
            assert cache.counters().up is not pauses  # the metric: joined, and not paused
            assert cache.stats.puts == 0 and cache.stats.misses == 1
        finally:
            cache.close()

    asyncio.run(run())
