"""The universal fallback: GET /v1/embeddings/{hash} (safetensors bytes) over HTTP."""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np

from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.handles import EmbeddingHandle


def safetensors_payload(body: bytes) -> memoryview:
    """The data bytes of a one-tensor safetensors file."""
    (header_len,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8: 8 + header_len])
    (meta,) = [v for k, v in header.items() if k != "__metadata__"]
    start, end = meta["data_offsets"]
    return memoryview(body)[8 + header_len + start: 8 + header_len + end]


class HttpConsumer:
    name = "http"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self._client = httpx.Client(timeout=timeout_s)

    def usable(self, handle: EmbeddingHandle) -> bool:
        return bool(handle.http)

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        try:
            resp = self._client.get(handle.http)
        except httpx.HTTPError as e:
            raise TransferError(f"http: cannot reach {handle.http}: {e!r}") from e
        if resp.status_code != 200:
            raise TransferError(f"http: {handle.http} answered {resp.status_code}: {resp.text[:200]}")
        payload = safetensors_payload(resp.content)
        if payload.nbytes != handle.nbytes:
            raise TransferError(f"http: got {payload.nbytes} bytes, expected {handle.nbytes}")
        np.copyto(dst, np.frombuffer(payload, np.uint8))

    def close(self) -> None:
        self._client.close()
