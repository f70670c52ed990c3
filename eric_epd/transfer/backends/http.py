"""The universal fallback: GET /v1/embeddings/{hash} (safetensors bytes) over HTTP."""

from __future__ import annotations

import httpx
import numpy as np

from eric_epd.common.http import bearer
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.safetensors_io import safetensors_payload
from eric_epd.wire.handles import LEASE_HEADER, EmbeddingHandle


class HttpConsumer:
    """The fallback consumer: GET of the producer's /v1/embeddings/{hash} under the handle's lease."""

    name = "http"

    def __init__(self, timeout_s: float = 30.0, api_key: str | None = None) -> None:
        self._client = httpx.Client(timeout=timeout_s, headers=bearer(api_key))

    def usable(self, handle: EmbeddingHandle) -> bool:
        """Whether the handle names an HTTP URL to read it from."""
        return bool(handle.http)

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        """`ConsumerBackend` hook: GET the safetensors bytes and copy their payload into `dst`."""
        try:
            resp = self._client.get(handle.http, headers={LEASE_HEADER: handle.lease})
        except httpx.HTTPError as e:
            raise TransferError(f"http: cannot reach {handle.http}: {e!r}") from e
        if resp.status_code != 200:
            raise TransferError(f"http: {handle.http} answered {resp.status_code}: {resp.text[:200]}")
        payload = safetensors_payload(resp.content)
        if payload.nbytes != handle.nbytes:
            raise TransferError(f"http: got {payload.nbytes} bytes, expected {handle.nbytes}")
        np.copyto(dst, np.frombuffer(payload, np.uint8))

    def close(self) -> None:
        """`ConsumerBackend` hook: close the HTTP client."""
        self._client.close()
