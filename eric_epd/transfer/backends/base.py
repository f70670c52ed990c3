"""The two interfaces every transfer backend implements."""

from __future__ import annotations

from typing import Protocol

import msgspec
import numpy as np

from eric_epd.wire.handles import EmbeddingHandle


class ProducerBackend(Protocol):
    """Runs in the Eric process that owns the pool; makes pool memory readable by remote consumers."""

    name: str

    def register(self, base_addr: int, nbytes: int) -> None:
        """Register the whole pool once (it never moves)."""

    def location(self, offset: int) -> msgspec.Struct:
        """The backend's part of an EmbeddingHandle for the bytes at pool `offset`."""

    def metadata(self) -> bytes:
        """Out-of-band connection data a consumer needs first (e.g. NIXL agent metadata); b"" if none."""

    def close(self) -> None:
        """Release the backend's registrations and connections."""


class ConsumerBackend(Protocol):
    """Runs in the consumer (an inference engine's worker); pulls bytes into a caller-provided buffer."""

    name: str

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        """Copy handle.nbytes bytes into dst (a C-contiguous uint8 array of exactly that size); raise
        TransferError naming the cause when it cannot."""

    def close(self) -> None:
        """Release the backend's registrations and connections."""


class TransferError(Exception):
    """A fetch failed: the producer is gone or restarted, the entry expired, or the backend failed."""
