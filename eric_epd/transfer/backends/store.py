"""Consumer side of the global cache: read an embedding from Mooncake Store by content hash when its producer no
longer holds it (acknowledged, expired, or the Eric is gone). The bytes are content-addressed, so no ack is due."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.global_cache import NOT_FOUND, store_key
from eric_epd.wire.handles import DTYPE_BYTES, EmbeddingHandle, is_content_hash

logger = logging.getLogger(__name__)

LOCAL_BUFFER_BYTES = 16 << 20


class StoreConsumer:
    """A store client that contributes no memory to the store (it only reads); joined on first use."""

    name = "store"

    def __init__(self, master: str, local_hostname: str, protocol: str = "tcp", device: str = "") -> None:
        self._master = master
        self._hostname = local_hostname
        self._protocol = protocol
        self._device = device
        self._store: Any = None
        self._lock = threading.Lock()

    def _client(self) -> Any:
        with self._lock:
            if self._store is None:
                from mooncake.store import MooncakeDistributedStore

                store = MooncakeDistributedStore()
                rc = store.setup(
                    self._hostname, "P2PHANDSHAKE", 0, LOCAL_BUFFER_BYTES, self._protocol, self._device, self._master
                )
                if rc != 0:
                    raise TransferError(f"store: cannot join Mooncake Store at {self._master} (setup rc={rc})")
                logger.info("global cache: reading from Mooncake Store at %s", self._master)
                self._store = store
            return self._store

    def usable(self, handle: EmbeddingHandle) -> bool:
        """True for any handle: the store reads by content hash and dtype, not by the handle's locations."""
        return True  # any handle: the key is its content hash and dtype

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        """`ConsumerBackend` hook: read the embedding from Mooncake Store straight into `dst`, by content hash."""
        if not is_content_hash(handle.hash) or handle.dtype not in DTYPE_BYTES:
            raise TransferError(f"store: {handle.hash[:16]!r} {handle.dtype!r} names no embedding Eric stores")
        store = self._client()
        key = store_key(handle.hash, handle.dtype)
        rc = store.register_buffer(dst.ctypes.data, dst.nbytes)
        if rc != 0:
            raise TransferError(f"store: cannot register the destination (rc={rc})")
        try:
            got = store.get_into(key, dst.ctypes.data, dst.nbytes)
        finally:
            store.unregister_buffer(dst.ctypes.data)
        if got == NOT_FOUND:
            raise TransferError(f"store: {handle.hash[:16]} is not in the global cache")
        if got != handle.nbytes:
            raise TransferError(f"store: read of {handle.hash[:16]} returned {got}, expected {handle.nbytes} bytes")

    def close(self) -> None:
        """`ConsumerBackend` hook: close the store client, if one was set up."""
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
