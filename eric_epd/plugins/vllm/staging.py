"""Prefetch of Eric embeddings for the vLLM connector: before a request is scheduled, a background thread has every
worker land its items in the worker's own device memory (`landing`), then acknowledges them to Eric (which answers a
child lease in their place, for a fetch again after a preemption: kept.py); the scheduler here only accounts for the
landing areas' space."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from eric_epd.plugins.vllm.landing import LandingChannel, LandingTimeoutError
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.transfer.free_list import FreeList
from eric_epd.wire.handles import EmbeddingHandle

logger = logging.getLogger(__name__)

ACK_ATTEMPT_S = 2.0
"""An acknowledgement unanswered this long is sent again on a new connection (within the fetch timeout)."""


class State(enum.Enum):
    """Where a staged embedding's fetch stands: running, landed on every rank, or failed."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Staged:
    """One embedding in the landing areas. `users`: requests waiting to be scheduled with it; `in_steps`: steps
    sent to the workers that copy it (its space is reused only when both are empty)."""

    key: str
    offset: int
    handle: EmbeddingHandle
    state: State = State.PENDING
    error: str = ""
    users: set[str] = field(default_factory=set)
    in_steps: int = 0
    backend: str = ""
    """The transport the bytes came over (shm, nixl, mooncake, http)."""
    late: int = 0
    """Landings some rank has not reported on yet (it may still write there): the space waits for them."""
    holds_slot: bool = False
    """Its fetch ended with ranks still reading: its producer's fetch slot stays taken until they answer, so a
    stalled Eric's reads never fill the workers' landing threads that other Erics' items need."""
    unacked: bool = True
    """No acknowledgement was tried: if the fetch fails, the lease is given back once no rank reads any more."""
    names: set[str] = field(default_factory=set)
    """Every vLLM identifier it is staged under: one lease may name two items (two videos' identical soundtracks,
    aliases.py), and is fetched and acknowledged once for both."""
    kept: EmbeddingHandle | None = None
    """The child lease Eric answered the acknowledgement with, until the scheduler takes it (`take_kept`); given
    back if the item leaves the landing area untaken."""


@dataclass(frozen=True)
class StagedLoad:
    """Scheduler -> workers: where one landed embedding lies in every worker's landing area (a byte range, its
    tensor)."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    content: str = ""
    """The Eric content hash of what landed there (vLLM may name the item otherwise: aliases.py)."""


class Prefetcher:
    """Scheduler side (EngineCore process). Not a cache: an item lives here from its first request's prefetch until
    the step that copies it reaches the workers, or until no request wants it. A failed item is never reused: the
    next request that wants its hash fetches it again with its own lease, and its range comes back once its own
    requests are done with it and every rank has answered. Thread-safe. `fetcher` only acknowledges (the workers
    read); `nbytes` is the size of every worker's landing area; a request finds no room for `room_timeout_s` (the
    landing timeout by default) at most."""

    def __init__(
        self,
        channel: LandingChannel,
        fetcher: EmbeddingFetcher,
        nbytes: int,
        threads: int,
        land_timeout_s: float,
        room_timeout_s: float | None = None,
    ) -> None:
        self._channel = channel
        self._fetcher = fetcher
        self._land_timeout_s = land_timeout_s
        self._room_timeout_s = land_timeout_s if room_timeout_s is None else room_timeout_s
        self.nbytes = nbytes
        self._free = FreeList(nbytes)
        self._items: dict[str, Staged] = {}
        self._retired: dict[int, Staged] = {}  # offset -> failed item replaced by a new fetch, its range not free yet
        self._no_room: dict[str, float] = {}  # request id -> when it first found no room
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._running = 0  # fetches not yet ended (busy() is asked at every engine step)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eric-prefetch")
        self._per_producer = max(1, threads - 1)
        """Fetches one Eric runs at once: a stalled one (each fetch then waits out its timeouts) leaves a thread to
        the others, whose items would otherwise queue behind its own."""
        self._fetching: Counter[str] = Counter()  # producer -> its fetches running in the pool
        self._queued: dict[str, deque[Staged]] = {}  # producer -> its fetches waiting for one of them to end
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="eric-give-back")  # a stalled Eric delays no fetch

    def want(self, key: str, handle: EmbeddingHandle, rid: str) -> Staged | None:
        """The item for request `rid`, its fetch started with `handle` if it is not here yet, or if it failed for
        other requests; None when the staging area has no room now (retry at a later step). Raises TransferError if
        it can never fit, or found no room for too long."""
        self._check_size(key, handle)
        with self._lock:
            item = self._items.get(key)
            if item is not None and item.state is State.FAILED and rid not in item.users:
                del self._items[key]  # its own requests still see it failed; this one fetches anew
                self._retired[item.offset] = item
                self._maybe_free(item)
                item = None
            if item is None:
                item = self._twin(handle)
                if item is not None:
                    self._items[key] = item
                    item.names.add(key)
            if item is None:
                offset = self._free.allocate(handle.nbytes)
                if offset is None:
                    self._no_room_for(rid, f"embedding {key[:16]}")
                    return None
                item = self._items[key] = Staged(key, offset, handle, names={key})
                self._running += 1
                self._launch(item)
            self._no_room.pop(rid, None)
            item.users.add(rid)
            return item

    def fits(self, rid: str, wants: list[tuple[str, EmbeddingHandle]]) -> bool:
        """Whether the landing areas have room now for every item of `wants` (key, handle) not staged yet, all at
        once: a request starts its fetches all or none, so two requests never each hold part of what they need while
        what is left fits neither (both then failed at the room timeout). False until they fit (retry at a later
        step); TransferError once request `rid` found no room for the room timeout, or an item can never fit."""
        with self._lock:
            sizes = [h.nbytes for key, h in wants if self._needs_room(key, h)]
            taken: list[tuple[int, int]] = []
            for nbytes in sizes:  # the allocator is first fit: allocating and freeing again leaves it as it was
                if (offset := self._free.allocate(nbytes)) is None:
                    break
                taken.append((offset, nbytes))
            for offset, nbytes in taken:
                self._free.free(offset, nbytes)
            if len(taken) == len(sizes):
                return True
            self._no_room_for(rid, f"{len(sizes)} embeddings ({sum(sizes)} bytes)")
            return False

    def _check_size(self, key: str, handle: EmbeddingHandle) -> None:
        """TransferError for an item larger than the whole landing area: it can never fit."""
        if handle.nbytes > self.nbytes:
            raise TransferError(
                f"embedding {key[:16]} has {handle.nbytes} bytes, more than the connector's whole "
                f"landing area ({self.nbytes}; ec_connector_extra_config staging_bytes)"
            )

    def _no_room_for(self, rid: str, what: str) -> None:
        """Holds the lock. Request `rid` found no room for `what` now; TransferError once it has for the room
        timeout."""
        since = self._no_room.setdefault(rid, time.monotonic())
        if time.monotonic() - since > self._room_timeout_s:
            del self._no_room[rid]
            raise TransferError(
                f"no room for {what} in the landing area for {self._room_timeout_s:g} s "
                "(ec_connector_extra_config staging_bytes)"
            )

    def _needs_room(self, key: str, handle: EmbeddingHandle) -> bool:
        """Holds the lock. Whether fetching `key` with `handle` takes space (it is not staged, live, already)."""
        self._check_size(key, handle)
        item = self._items.get(key)
        return (item is None or item.state is State.FAILED) and self._twin(handle) is None

    def _launch(self, item: Staged) -> None:
        """Holds the lock. Run the item's fetch now, or once one of its producer's running fetches has ended."""
        producer = item.handle.producer
        if self._fetching[producer] < self._per_producer:
            self._fetching[producer] += 1
            self._pool.submit(self._fetch, item)
        else:
            self._queued.setdefault(producer, deque()).append(item)

    def _next_of(self, producer: str) -> None:
        """Holds the lock. One of `producer`'s fetches ended: start its next queued one, if any."""
        self._fetching[producer] -= 1
        queued = self._queued.get(producer)
        if queued:
            self._launch(queued.popleft())
            if not queued:
                del self._queued[producer]
        if self._fetching[producer] <= 0:
            del self._fetching[producer]

    def _twin(self, handle: EmbeddingHandle) -> Staged | None:
        """Holds the lock. The live item fetched (or being fetched) with this very lease, under another name."""
        return next(
            (
                i
                for i in self._items.values()
                if i.handle.lease == handle.lease and i.handle.hash == handle.hash and i.state is not State.FAILED
            ),
            None,
        )

    def get(self, key: str) -> Staged | None:
        """The staged item under this content hash, or None."""
        with self._lock:
            return self._items.get(key)

    def ready(self, key: str) -> bool:
        """Whether the item under this content hash has landed on every rank."""
        item = self.get(key)
        return item is not None and item.state is State.READY

    def busy(self) -> bool:
        """True while a fetch is running."""
        with self._lock:
            return self._running > 0

    def wait(self, timeout_s: float) -> None:
        """Block until some fetch ends (or the timeout): the scheduler idles here instead of spinning."""
        self._done.wait(timeout_s)
        self._done.clear()

    def to_workers(self, key: str, rid: str) -> tuple[StagedLoad, str]:
        """The item goes to the workers in this step (and the transport it came over); it stays until that step's
        output is back (`copied`)."""
        with self._lock:
            item = self._items[key]
            item.users.discard(rid)
            item.in_steps += 1
            h = item.handle
            return StagedLoad(item.offset, h.nbytes, tuple(h.shape), h.dtype, h.hash), item.backend

    def take_kept(self, key: str) -> tuple[EmbeddingHandle | None, frozenset[str]]:
        """The child lease that took the place of the item's acknowledged one, now the caller's to give back (None
        if Eric answered none, or it was taken already), and every name the item is staged under."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None, frozenset({key})
            kept, item.kept = item.kept, None
            return kept, frozenset(item.names)

    def copied(self, keys: list[str]) -> None:
        """The workers copied these items (their step's output is back)."""
        with self._lock:
            for key in keys:
                item = self._items.get(key)
                if item is not None:
                    item.in_steps -= 1
                    self._maybe_free(item)

    def drop(self, key: str, rid: str) -> None:
        """Request `rid` no longer wants the item (it finished, or failed)."""
        with self._lock:
            self._no_room.pop(rid, None)
            held = [i for i in self._retired.values() if key in i.names]
            item = self._items.get(key)
            for staged in held if item is None else [item, *held]:
                staged.users.discard(rid)
                self._maybe_free(staged)

    def used_bytes(self) -> int:
        """Bytes of the landing area held by staged items."""
        with self._lock:
            return self.nbytes - self._free.free_bytes

    def _maybe_free(self, item: Staged) -> None:
        """Holds the lock. A running fetch keeps its space until it ends (it writes there); so does one some worker
        has not answered yet (it may write there still). The workers then drop their copies of the item."""
        if not item.users and item.in_steps <= 0 and item.state is not State.PENDING and item.late <= 0:
            mapped = [name for name in item.names if self._items.get(name) is item]
            retired = self._retired.get(item.offset) is item
            if not mapped and not retired:
                return  # freed already
            for name in mapped:
                del self._items[name]
            if retired:
                del self._retired[item.offset]
            self._free.free(item.offset, item.handle.nbytes)
            self._channel.release(item.offset)
            if item.kept is not None:  # no request was loaded with it: nothing will fetch it again
                self._releaser.submit(self._ack, item.kept)
                item.kept = None

    def _settled(self, item: Staged) -> None:
        """Every rank has now answered a landing of `item` that timed out."""
        with self._lock:
            item.late -= 1
            if item.late <= 0 and item.holds_slot:
                item.holds_slot = False
                self._next_of(item.handle.producer)
            self._give_back(item)
            self._maybe_free(item)

    def _give_back(self, item: Staged) -> None:
        """Holds the lock. A failed item's lease, never acknowledged, goes back to Eric (its pool space with it)."""
        if item.state is State.FAILED and item.late <= 0 and item.unacked:
            item.unacked = False
            self._releaser.submit(self._ack, item.handle)

    def _ack(self, h: EmbeddingHandle) -> None:
        try:
            self._fetcher.ack(h)
        except TransferError as e:
            logger.info("could not give back the lease of embedding %s: %s", h.hash[:16], e)

    def _fetch(self, item: Staged) -> None:
        """In a pool thread: every worker lands the bytes in the item's range, then the lease goes back to Eric."""
        h = item.handle
        late, kept = 0, None
        settled = lambda: self._settled(item)  # noqa: E731
        try:
            backend = self._channel.land(item.offset, h, self._land_timeout_s, settled=settled)
            item.unacked = False
            item.backend, kept = self._fetcher.confirm(
                h,
                backend,
                lambda: self._channel.land(item.offset, h, self._land_timeout_s, "store", settled),
                attempt_timeout_s=ACK_ATTEMPT_S,
                keep=True,
            )
            state, error = State.READY, ""
        except (TransferError, ValueError) as e:
            late = int(isinstance(e, LandingTimeoutError))
            logger.error("cannot fetch embedding %s from %s: %s", item.key[:16], h.producer, e)
            state, error = State.FAILED, str(e)
        except Exception as e:  # never leave an item pending forever: its request would wait without end
            logger.exception("fetch of embedding %s failed", item.key[:16])
            state, error = State.FAILED, f"{type(e).__name__}: {e}"
        with self._lock:
            item.state, item.error, item.kept = state, error, kept
            item.late += late  # its `settled` may have come first
            self._running -= 1
            if item.late > 0:
                item.holds_slot = True
            else:
                self._next_of(h.producer)
            self._give_back(item)
            self._maybe_free(item)
        self._done.set()

    def close(self) -> None:
        """Stop the fetch and release threads, then close the landing channel and the fetcher."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._releaser.shutdown(wait=True, cancel_futures=True)
        self._channel.close()
        self._fetcher.close()
