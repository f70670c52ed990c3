"""Eric's second cache tier: finished embeddings shared by every Eric through Mooncake Store, keyed by content hash.

An Eric that misses in its own pool reads the store into the region it reserved before encoding; one that encoded
an item puts it (while a lease keeps the region). The store going down turns every call into a miss: logged and
counted, never a failed request. Store calls block, so they run on a small thread pool of the cache's own (a hung
store never starves media DNS or decoding on the default one), skipped once queued if the store was found down."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from eric_epd.common.to_the_end import to_the_end

logger = logging.getLogger(__name__)

RETRY_SETUP_S = 10.0
PAUSE_AFTER_ERROR_S = 10.0
"""After a failed store call, calls are skipped (misses at once) this long: a store that is down answers only after
its RPC timeout (seconds), which every local miss would otherwise wait for."""
READ_WAIT_S = 5.0
"""A request waits this long for its store reads (a hit takes milliseconds; a store whose master stopped answers only
after Mooncake's 30 s RPC timeout), then encodes the items itself (service.py detaches the regions still read into)."""
NOT_FOUND = -704
"""Mooncake Store's return code for a key it does not hold."""
ANSWERS = frozenset({NOT_FOUND, -703, -705, -200})
"""Mooncake Store's codes that say the store works (types.h): not found, a replica another Eric is still putting
(REPLICA_IS_NOT_READY, a miss for now), a key already put (OBJECT_ALREADY_EXISTS), no space at its high watermark
(NO_AVAILABLE_HANDLE: this put is skipped). None of them pauses the cache, as a failure does."""
SKIPPED = -1_000_001
"""What a queued store call returns when the store was found down before it started (it never ran)."""
STORE_THREADS = 4
"""Threads of the cache's own pool: the most store calls blocked at once."""
MAX_PUTS = 16
"""Puts in flight at most (each holds a lease and a fence on its region); fresh embeddings past it are not shared."""


def store_key(content_hash: str, dtype: str) -> str:
    """The store's key of an embedding: its content hash (which names the model's output space) under its dtype.
    Producers write and consumers read under this one name."""
    return f"eric-emb/{dtype}/{content_hash}"


@dataclass
class CacheStats:
    """Counters of the global cache since start, exported by Eric's metrics."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    up: bool = False
    """Joined to the store and not paused after a failure (refreshed when read: `GlobalCache.counters`)."""
    capacity: int = 0
    """Bytes this Eric gives the store (its share of the global tier; the master evicts at its high watermark)."""


class GlobalCache:
    """One store client per Eric router; `pool` is the embedding pool's memory (registered once with the store)."""

    def __init__(
        self,
        master: str,
        local_hostname: str,
        segment_bytes: int,
        pool: np.ndarray,
        namespace: str,
        protocol: str = "tcp",
        read_wait_s: float = READ_WAIT_S,
    ) -> None:
        self._master = master
        self.read_wait_s = read_wait_s
        self._namespace = namespace
        self._hostname = local_hostname
        self._segment_bytes = segment_bytes
        self._pool = pool
        self._protocol = protocol
        self._store: Any = None
        self._next_setup = 0.0
        self._setting_up: asyncio.Task[None] | None = None
        self._paused_until = 0.0
        self._threads = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="global-cache")
        self._puts = 0
        self.stats = CacheStats(capacity=segment_bytes)

    def counters(self) -> CacheStats:
        """The counters, `up` as of now: joined, and not paused after a failed call."""
        self.stats.up = self._store is not None and time.monotonic() >= self._paused_until
        return self.stats

    @property
    def accepting_puts(self) -> bool:
        """Whether a fresh embedding may be shared now: the store not found down, fewer than MAX_PUTS in flight."""
        return self._puts < MAX_PUTS and time.monotonic() >= self._paused_until

    async def _call(self, call: Callable[..., int], *args: object) -> int:
        """`call(*args)` on the cache's own threads; SKIPPED without calling if, once its thread is free, the store
        has been found down meanwhile (calls queued behind a hung one do not each wait out its timeout)."""

        def unless_paused() -> int:
            if time.monotonic() < self._paused_until:
                return SKIPPED
            rc = -1  # what a call that raises counts as
            try:
                rc = call(*args)
                return rc
            finally:  # paused here, in the thread, before it takes the next queued call
                if rc < 0 and rc not in ANSWERS:
                    self._paused_until = time.monotonic() + PAUSE_AFTER_ERROR_S

        return await asyncio.get_running_loop().run_in_executor(self._threads, unless_paused)

    def start(self) -> None:
        """Join the store in the background (requests meanwhile miss, they do not wait for it)."""
        self._kick()

    def _kick(self) -> None:
        if self._store is None and self._setting_up is None and time.monotonic() >= self._next_setup:
            self._next_setup = time.monotonic() + RETRY_SETUP_S
            self._setting_up = asyncio.create_task(self._join())

    async def _join(self) -> None:
        try:
            self._store = await asyncio.get_running_loop().run_in_executor(self._threads, self._setup)
        finally:
            self._setting_up = None

    async def _ready(self, wait: bool) -> Any:
        """The store client; None while it is not joined (set up again at most every RETRY_SETUP_S after a failure).
        With `wait`, a join in progress is waited for (writes run in the background: they can)."""
        self._kick()
        if wait and self._setting_up is not None:
            await asyncio.shield(self._setting_up)
        if time.monotonic() < self._paused_until:
            return None
        return self._store

    def _setup(self) -> Any:
        try:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            rc = store.setup(
                self._hostname, "P2PHANDSHAKE", self._segment_bytes, 16 << 20, self._protocol, "", self._master
            )
            if rc != 0:
                raise RuntimeError(f"setup rc={rc}")
            rc = store.register_buffer(self._pool.ctypes.data, self._pool.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer rc={rc}")
        except Exception as e:  # the store is down or unreachable: this Eric serves from its own pool meanwhile
            logger.warning("global cache at %s unavailable (%r); serving from the local pool only", self._master, e)
            return None
        logger.info("global cache: joined Mooncake Store at %s with %d bytes", self._master, self._segment_bytes)
        return store

    async def read_into(self, key: str, region: np.ndarray) -> bool:
        """Fill `region` (a view on the pool) with the stored embedding of `key`; False on a miss or any error."""
        store = await self._ready(wait=False)
        if store is None:
            self.stats.misses += 1
            return False
        try:
            got = await self._call(store.get_into, self._key(key), region.ctypes.data, region.nbytes)
        except Exception as e:
            got = -1
            logger.warning("global cache read of %s failed: %r", key[:12], e)
        if got == region.nbytes:
            self.stats.hits += 1
            self.stats.bytes_read += got
            return True
        self.stats.misses += 1
        if got < 0 and got not in ANSWERS and got != SKIPPED:
            self._failed(f"get {key[:12]} rc={got}")
        return False

    def write(self, key: str, region: np.ndarray) -> Coroutine[Any, Any, None]:
        """Store the embedding of `key` from `region` (await, or run as a task, what this returns); the caller keeps
        the region alive until that ends. Counted in flight at once, not when it starts running: a request sharing
        dozens of items in one step of the event loop stays within MAX_PUTS."""
        self._puts += 1
        return self._write(key, region)

    async def _write(self, key: str, region: np.ndarray) -> None:
        try:
            store = await self._ready(wait=True)
            if store is None:
                return
            copy = asyncio.ensure_future(self._call(store.put_from, self._key(key), region.ctypes.data, region.nbytes))
            try:
                rc = await to_the_end(copy)
            except Exception as e:
                rc = -1
                logger.warning("global cache write of %s failed: %r", key[:12], e)
            if rc == 0:
                self.stats.puts += 1
                self.stats.bytes_written += region.nbytes
            elif rc in ANSWERS:
                logger.debug("global cache put of %s not done: rc=%d", key[:12], rc)
            elif rc != SKIPPED:
                self._failed(f"put {key[:12]} rc={rc}")
        finally:
            self._puts -= 1

    def timed_out(self, count: int) -> None:
        """Reads a request stopped waiting for (they go on in their threads): the store is taken as down for now."""
        self._failed(f"{count} reads unanswered after {self.read_wait_s:g} s")

    def _failed(self, what: str) -> None:
        self._paused_until = time.monotonic() + PAUSE_AFTER_ERROR_S
        self.stats.errors += 1
        if self.stats.errors in (1, 10, 100) or self.stats.errors % 1000 == 0:
            logger.warning(
                "global cache: %s (%d errors so far); the local pool alone serves for the next %g s",
                what,
                self.stats.errors,
                PAUSE_AFTER_ERROR_S,
            )

    def _key(self, key: str) -> str:
        return store_key(key, self._namespace)

    def close(self) -> None:
        """Close the store client, if one was set up (errors are logged, not raised); calls still queued never run."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            try:
                self._store.close()
            except Exception as e:
                logger.warning("global cache close: %r", e)
            self._store = None
