"""Same-host backend: the consumer maps the pool's shared-memory segment and copies the entry out."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from eric_epd.common.shm import Segment, attach_untracked
from eric_epd.transfer.backends.base import TransferError
from eric_epd.wire.handles import EmbeddingHandle, ShmLocation

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory segments are named on Linux: a mapped pool whose name is gone here was unlinked."""
PRUNE_EVERY_S = 10.0
"""How often reads look for mapped pools that were unlinked (a new mapping always looks)."""


def host_id() -> str:
    """Identifies this host's shared-memory namespace (the kernel boot id; the hostname where unavailable)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


class ShmProducer:
    """The same-host producer: a handle names the pool's shared-memory segment, the offset and this host."""

    name = "shm"

    def __init__(self, pool_name: str) -> None:
        self._pool_name = pool_name
        self._host_id = host_id()

    def register(self, base_addr: int, nbytes: int) -> None:
        """Nothing to register: the pool already is a named segment."""

    def location(self, offset: int) -> ShmLocation:
        """`ProducerBackend` hook: the pool's segment name, the offset and this host's id."""
        return ShmLocation(self._pool_name, offset, self._host_id)

    def metadata(self) -> bytes:
        """`ProducerBackend` hook: nothing (the segment's name is all a consumer needs)."""
        return b""

    def close(self) -> None:
        """The pool owns the segment."""


class ShmConsumer:
    """Maps each producer's pool once and keeps it mapped while it lives: a producer's former pool is unmapped when
    its new one is first read (a restart), and any pool whose segment was unlinked at the next mapping or within
    PRUNE_EVERY_S; a vanished segment raises TransferError."""

    name = "shm"

    def __init__(self) -> None:
        self._host_id = host_id()
        self._segments: dict[str, tuple[Segment, np.ndarray]] = {}
        self._pools: dict[str, str] = {}  # producer URL -> the segment name it was last read from
        self._pruned_at = time.monotonic()
        self._lock = threading.Lock()

    def usable(self, handle: EmbeddingHandle) -> bool:
        """Whether the handle has a shared-memory location on this host."""
        return handle.shm is not None and handle.shm.host_id == self._host_id

    def mapped(self) -> list[str]:
        """Names of the pool segments mapped now."""
        with self._lock:
            return list(self._segments)

    def _pool(self, loc: ShmLocation, producer: str) -> np.ndarray:
        with self._lock:
            former = self._pools.get(producer)
            self._pools[producer] = loc.name
            if former is not None and former != loc.name and former not in self._pools.values():
                self._unmap(former, "its producer now serves another pool")
            cached = self._segments.get(loc.name)
            if cached is None or time.monotonic() - self._pruned_at > PRUNE_EVERY_S:
                self._prune()
            if cached is None:
                try:
                    segment = attach_untracked(loc.name)
                except FileNotFoundError as e:
                    raise TransferError(f"shm: pool segment {loc.name} is gone (producer stopped or restarted)") from e
                cached = (segment, np.ndarray((segment.size,), np.uint8, buffer=segment.buf))
                self._segments[loc.name] = cached
            return cached[1]

    def _prune(self) -> None:
        """Holds the lock: unmap the pools whose segment was unlinked (their producer stopped)."""
        self._pruned_at = time.monotonic()
        if os.path.isdir(SHM_DIR):
            for name in [n for n in self._segments if not os.path.exists(os.path.join(SHM_DIR, n.lstrip("/")))]:
                self._unmap(name, "its segment was unlinked")

    def _unmap(self, name: str, why: str = "") -> None:
        """Holds the lock. Reads still copying out of it keep the mapping alive until they end."""
        cached = self._segments.pop(name, None)
        if cached is not None:
            if why:
                logger.info("shm: unmapping pool %s: %s", name, why)
            segment = cached[0]
            del cached
            segment.close()

    def _entry(self, handle: EmbeddingHandle) -> np.ndarray:
        if not self.usable(handle):
            raise TransferError("shm: handle is from another host")
        assert handle.shm is not None
        pool = self._pool(handle.shm, handle.producer)
        end = handle.shm.offset + handle.nbytes
        if handle.shm.offset < 0 or handle.nbytes < 0 or end > pool.nbytes:
            raise TransferError(f"shm: entry [{handle.shm.offset}, {end}) is outside pool {handle.shm.name}")
        return pool[handle.shm.offset : end]

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        """`ConsumerBackend` hook: copy the entry out of the mapped pool into `dst`."""
        np.copyto(dst, self._entry(handle))

    def read_tensor(self, handle: EmbeddingHandle, dst: torch.Tensor) -> None:
        """One copy from the producer's pool into a tensor on any device (a host-to-device copy on GPUs)."""
        dst.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(self._entry(handle)))

    def close(self) -> None:
        """`ConsumerBackend` hook: unmap every pool segment."""
        with self._lock:
            for name in list(self._segments):
                self._unmap(name)
            self._pools.clear()
