"""Scheduler-side lease calls of the connector: giving back the leases of items a request never fetched (vLLM had
them cached, or the request ended first). Lookups are local: handles come with requests."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.wire.handles import EmbeddingHandle

logger = logging.getLogger(__name__)

_MEDIA_KEYS = (
    "pixel_values",
    "pixel_values_videos",
    "image_embeds",
    "video_embeds",
    "input_features",
    "input_audio_features",
    "audio_embeds",
)
"""Fields of vLLM's processed items that its own encoder (or none, for embeds) turns into rows: pixels, audio
features (Qwen2-Audio's `input_features`, the Omni thinkers' `input_audio_features`) and given embeddings."""


def has_raw_media(feature: Any) -> bool:
    """True if vLLM can encode this item itself (its pixels or audio features came with the request, or its
    processor cache has them); False for a metadata-only item (grid but no pixels), which only an Eric can serve.
    Asked only of an item without an Eric handle: one with a handle is loaded from Eric even when its media came too
    (placement "media", the generic path, where vLLM's processor needs the media to lay out the placeholder)."""
    data = getattr(feature, "data", None)
    if data is None:
        return True
    return any(key in data for key in _MEDIA_KEYS)


class LeaseClient:
    """Gives back, in a background thread (never on the scheduler's loop), the leases of items a request never
    fetched, through the same fetcher that acknowledges the items it did fetch."""

    def __init__(self, fetcher: EmbeddingFetcher) -> None:
        self._fetcher = fetcher
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="eric-release")

    def release(self, handles: Iterable[EmbeddingHandle], quiet: bool = False) -> None:
        """Acknowledge, in the background, the leases of items a request never loaded (or kept ones, `quiet`: that
        one lapsed or yielded to space is expected, logged at debug only)."""
        self._releaser.submit(self._release, list(handles), quiet)

    def _release(self, handles: list[EmbeddingHandle], quiet: bool) -> None:
        for h in handles:
            try:
                self._fetcher.ack(h)
                logger.debug("released lease on %s", h.hash[:12])
            except TransferError as e:
                logger.log(
                    logging.DEBUG if quiet else logging.WARNING, "could not release the lease on %s: %s", h.hash[:16], e
                )

    def close(self) -> None:
        """Finish the releases already queued (the fetcher is its owner's to close)."""
        self._releaser.shutdown(wait=True, cancel_futures=False)
