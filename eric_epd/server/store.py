"""Finished embeddings kept in the router, keyed by content hash, bounded by bytes (least recently used first out)."""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from dataclasses import dataclass

# safetensors dtype names for the dtypes an encoder emits
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class StoredEmbedding:
    hash: str
    shape: tuple[int, ...]
    dtype: str
    data: bytes

    def to_safetensors(self, name: str = "embedding") -> bytes:
        """The tensor as a safetensors file (one tensor named `name`)."""
        header = json.dumps({name: {"dtype": _SAFETENSORS_DTYPES[self.dtype], "shape": list(self.shape),
                                    "data_offsets": [0, len(self.data)]}}).encode()
        header += b" " * (-len(header) % 8)  # the format wants 8-byte alignment of the data
        return struct.pack("<Q", len(header)) + header + self.data


class EmbeddingStore:
    """LRU map hash -> embedding; put() evicts the oldest entries beyond max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredEmbedding] = OrderedDict()
        self._bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> StoredEmbedding | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, entry: StoredEmbedding) -> None:
        old = self._entries.pop(entry.hash, None)
        if old is not None:
            self._bytes -= len(old.data)
        self._entries[entry.hash] = entry
        self._bytes += len(entry.data)
        while self._bytes > self._max_bytes and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted.data)
