"""Where the gateway places an image, computed as its encoder pool does: tests put work on a chosen Eric by
construction instead of hoping random ports spread it."""

from __future__ import annotations

from collections.abc import Iterable

from epd_gateway.content import MediaRef
from epd_gateway.members import rendezvous_weight


def rendezvous_first(media_url: str, encoder_urls: Iterable[str]) -> str:
    """The encoder URL this media URL goes to when every encoder is healthy and none is loaded."""
    key = MediaRef(0, 0, "image", media_url).routing_key
    return max(encoder_urls, key=lambda url: rendezvous_weight(key, url))
