"""Scheduler-side lookup of which Eric holds an embedding, by content hash (vLLM's multimodal identifier)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

logger = logging.getLogger(__name__)

_CONTENT_HASH = re.compile(r"^[0-9a-f]{64}$")
_NEGATIVE_TTL_S = 2.0
_MAX_CACHED = 4096
_MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "image_embeds", "video_embeds")


def is_content_hash(identifier: str) -> bool:
    return bool(_CONTENT_HASH.match(identifier))


def has_raw_media(feature: Any) -> bool:
    """True if vLLM can encode this item itself (its pixels came with the request, or its processor cache has
    them); False for a metadata-only item (grid but no pixels), which only an Eric can serve."""
    data = getattr(feature, "data", None)
    if data is None:
        return True
    return any(key in data for key in _MEDIA_KEYS)


class HandleResolver:
    """identifier -> EmbeddingHandle (JSON form) held by one of the Erics, or None.

    Positive answers are kept until forget() (one resolution per load: an entry freed and re-encoded gets a new
    generation, so stale handles are never reused); negative answers for a couple of seconds.
    """

    def __init__(self, eric_urls: Sequence[str], timeout_s: float) -> None:
        self._urls = tuple(eric_urls)
        self._client = httpx.Client(timeout=timeout_s)
        self._found: dict[str, dict[str, Any]] = {}
        self._missing: dict[str, float] = {}
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="eric-release")

    def lookup(self, identifier: str) -> dict[str, Any] | None:
        if not is_content_hash(identifier):
            return None  # not an Eric content hash (vLLM's own hash, or a LoRA-prefixed identifier)
        if (found := self._found.get(identifier)) is not None:
            return found
        if self._missing.get(identifier, 0.0) > time.monotonic():
            return None
        for url in self._urls:
            handle = self._ask(url, identifier)
            if handle is not None:
                if len(self._found) >= _MAX_CACHED:
                    self._found.pop(next(iter(self._found)))
                self._found[identifier] = handle
                return handle
        self._missing[identifier] = time.monotonic() + _NEGATIVE_TTL_S
        if len(self._missing) > _MAX_CACHED:
            now = time.monotonic()
            self._missing = {k: v for k, v in self._missing.items() if v > now}
        return None

    def _ask(self, url: str, identifier: str) -> dict[str, Any] | None:
        try:
            resp = self._client.get(f"{url}/v1/embeddings/{identifier}/handle")
        except httpx.HTTPError as e:
            logger.warning("Eric at %s unreachable: %r", url, e)
            return None
        return resp.json() if resp.status_code == 200 else None

    def add_leases(self, handle: dict[str, Any], count: int) -> None:
        try:
            self._client.post(f"{handle['producer']}/v1/embeddings/{handle['hash']}/lease", json={"count": count})
        except httpx.HTTPError as e:
            logger.warning("could not add %d leases on %s: %r", count, handle["hash"], e)

    def forget(self, identifier: str) -> None:
        self._found.pop(identifier, None)

    def release(self, identifiers: Iterable[str]) -> None:
        """Return, in the background, the lease each encode request took on these items when they were never
        fetched (vLLM already held them in its encoder cache), so Eric need not keep them until the TTL."""
        self._releaser.submit(self._release, list(identifiers))

    def _release(self, identifiers: list[str]) -> None:
        for identifier in identifiers:
            for url in self._urls:  # asked afresh: the scheduler thread owns the caches
                handle = self._ask(url, identifier)
                if handle is None:
                    continue
                try:
                    resp = self._client.post(f"{handle['producer']}/v1/embeddings/{identifier}/ack",
                                             json={"instance_id": handle["instance_id"],
                                                   "generation": handle["generation"]})
                    logger.debug("released unused lease on %s: %d", identifier[:12], resp.status_code)
                except httpx.HTTPError as e:
                    logger.warning("could not release the lease on %s: %r", identifier, e)
                break

    def close(self) -> None:
        self._releaser.shutdown(wait=True, cancel_futures=False)
        self._client.close()
