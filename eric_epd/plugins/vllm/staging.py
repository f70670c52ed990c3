"""Prefetch of Eric embeddings for the vLLM connector: the scheduler fetches each item in a background thread into a
shared-memory staging area before its request is scheduled; workers then only copy it into the encoder cache."""

from __future__ import annotations

import enum
import logging
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from eric_epd.common.shm import Segment, attach_untracked
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.transfer.handles import EmbeddingHandle
from eric_epd.transfer.pool import FreeList

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "eric_stage_"
ACK_ATTEMPT_S = 2.0
"""An acknowledgement unanswered this long is sent again on a new connection (within the fetch timeout)."""


class State(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Staged:
    """One embedding in the staging area. `users`: requests waiting to be scheduled with it; `in_steps`: steps
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


@dataclass(frozen=True)
class StagedLoad:
    """Scheduler -> workers: where one staged embedding lies (the segment's name, a byte range, its tensor)."""

    segment: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


class Prefetcher:
    """Scheduler side (EngineCore process). Not a cache: an item lives here from its first request's prefetch until
    the step that copies it reaches the workers, or until no request wants it. Thread-safe."""

    def __init__(self, fetcher: EmbeddingFetcher, nbytes: int, threads: int) -> None:
        self._fetcher = fetcher
        self._segment = Segment(name=f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}", create=True, size=nbytes)
        self._array = np.ndarray((nbytes,), dtype=np.uint8, buffer=self._segment.buf)
        self.nbytes = nbytes
        self._free = FreeList(nbytes)
        self._items: dict[str, Staged] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._running = 0  # fetches not yet ended (busy() is asked at every engine step)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eric-prefetch")

    @property
    def segment_name(self) -> str:
        return self._segment.name

    def want(self, key: str, handle: EmbeddingHandle, rid: str) -> Staged | None:
        """The item for request `rid`, its fetch started with `handle` if it is not here yet; None when the
        staging area has no room now (retry at a later step). Raises TransferError if it can never fit."""
        if handle.nbytes > self.nbytes:
            raise TransferError(f"embedding {key[:16]} has {handle.nbytes} bytes, more than the connector's whole "
                                f"staging area ({self.nbytes}; ec_connector_extra_config staging_bytes)")
        with self._lock:
            item = self._items.get(key)
            if item is None:
                offset = self._free.allocate(handle.nbytes)
                if offset is None:
                    return None
                item = self._items[key] = Staged(key, offset, handle)
                self._running += 1
                self._pool.submit(self._fetch, item)
            item.users.add(rid)
            return item

    def get(self, key: str) -> Staged | None:
        with self._lock:
            return self._items.get(key)

    def ready(self, key: str) -> bool:
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
            return StagedLoad(self._segment.name, item.offset, h.nbytes, tuple(h.shape), h.dtype), item.backend

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
            item = self._items.get(key)
            if item is not None:
                item.users.discard(rid)
                self._maybe_free(item)

    def used_bytes(self) -> int:
        with self._lock:
            return self.nbytes - self._free.free_bytes

    def _maybe_free(self, item: Staged) -> None:
        """Holds the lock. A running fetch keeps its space until it ends (it writes there)."""
        if not item.users and item.in_steps <= 0 and item.state is not State.PENDING:
            del self._items[item.key]
            self._free.free(item.offset, item.handle.nbytes)

    def _fetch(self, item: Staged) -> None:
        """In a pool thread: read the bytes into the item's range, then acknowledge the lease to Eric."""
        h = item.handle
        try:
            item.backend = self._fetcher.read_into(h, self._array[item.offset : item.offset + h.nbytes])
            self._fetcher.ack(h, attempt_timeout_s=ACK_ATTEMPT_S)
            state, error = State.READY, ""
        except (TransferError, ValueError) as e:
            logger.error("cannot fetch embedding %s from %s: %s", item.key[:16], h.producer, e)
            state, error = State.FAILED, str(e)
        except Exception as e:  # never leave an item pending forever: its request would wait without end
            logger.exception("fetch of embedding %s failed", item.key[:16])
            state, error = State.FAILED, f"{type(e).__name__}: {e}"
        with self._lock:
            item.state, item.error = state, error
            self._running -= 1
            self._maybe_free(item)
        self._done.set()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._fetcher.close()
        self._array = np.empty(0, dtype=np.uint8)
        self._segment.close()
        try:
            self._segment.unlink()
        except FileNotFoundError:
            pass


class StagingReader:
    """Worker side: maps the scheduler's staging segment (once) and copies staged embeddings out of it."""

    def __init__(self) -> None:
        self._segments: dict[str, tuple[Segment, np.ndarray]] = {}

    def tensor(self, load: StagedLoad, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new tensor on `device` holding the staged rows (converted to the model's dtype)."""
        if not load.segment.startswith(SEGMENT_PREFIX):
            raise ValueError(f"not a staging segment: {load.segment!r}")
        if load.segment not in self._segments:
            segment = attach_untracked(load.segment)
            self._segments[load.segment] = (segment, np.ndarray((segment.size,), dtype=np.uint8, buffer=segment.buf))
        array = self._segments[load.segment][1]
        raw = torch.from_numpy(array[load.offset : load.offset + load.nbytes])
        src = raw.view(getattr(torch, load.dtype)).view(load.shape)
        out = torch.empty(load.shape, dtype=dtype, device=device)
        out.copy_(src)
        return out

    def close(self) -> None:
        for segment, _ in self._segments.values():
            segment.close()
        self._segments.clear()
