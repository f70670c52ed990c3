"""Same-host backend: the consumer maps the pool's shared-memory segment and copies the entry out."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from eric_epd.common.shm import Segment, attach_untracked
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.handles import EmbeddingHandle, ShmLocation


def host_id() -> str:
    """Identifies this host's shared-memory namespace (the kernel boot id; the hostname where unavailable)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


class ShmProducer:
    name = "shm"

    def __init__(self, pool_name: str) -> None:
        self._pool_name = pool_name
        self._host_id = host_id()

    def register(self, base_addr: int, nbytes: int) -> None:
        """Nothing to register: the pool already is a named segment."""

    def location(self, offset: int) -> ShmLocation:
        return ShmLocation(self._pool_name, offset, self._host_id)

    def metadata(self) -> bytes:
        return b""

    def close(self) -> None:
        """The pool owns the segment."""


class ShmConsumer:
    """Maps each producer's pool once and keeps it mapped; a vanished segment raises TransferError."""

    name = "shm"

    def __init__(self) -> None:
        self._host_id = host_id()
        self._segments: dict[str, tuple[Segment, np.ndarray]] = {}
        self._lock = threading.Lock()

    def usable(self, handle: EmbeddingHandle) -> bool:
        return handle.shm is not None and handle.shm.host_id == self._host_id

    def _pool(self, loc: ShmLocation) -> np.ndarray:
        with self._lock:
            cached = self._segments.get(loc.name)
            if cached is None:
                try:
                    segment = attach_untracked(loc.name)
                except FileNotFoundError as e:
                    raise TransferError(f"shm: pool segment {loc.name} is gone (producer stopped or restarted)") from e
                cached = (segment, np.ndarray((segment.size,), np.uint8, buffer=segment.buf))
                self._segments[loc.name] = cached
            return cached[1]

    def _entry(self, handle: EmbeddingHandle) -> np.ndarray:
        if not self.usable(handle):
            raise TransferError("shm: handle is from another host")
        assert handle.shm is not None
        pool = self._pool(handle.shm)
        end = handle.shm.offset + handle.nbytes
        if handle.shm.offset < 0 or handle.nbytes < 0 or end > pool.nbytes:
            raise TransferError(f"shm: entry [{handle.shm.offset}, {end}) is outside pool {handle.shm.name}")
        return pool[handle.shm.offset: end]

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        np.copyto(dst, self._entry(handle))

    def read_tensor(self, handle: EmbeddingHandle, dst: torch.Tensor) -> None:
        """One copy from the producer's pool into a tensor on any device (a host-to-device copy on GPUs)."""
        dst.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(self._entry(handle)))

    def close(self) -> None:
        with self._lock:
            for segment, _ in self._segments.values():
                segment.close()
            self._segments.clear()
