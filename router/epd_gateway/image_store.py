"""Generated PNGs kept for clients that ask for `response_format: "url"`: each under an unguessable name (the URL is
the capability, as OpenAI's are) for a bounded time and within a byte budget, oldest dropped first."""

from __future__ import annotations

import re
import secrets
import time
from collections import OrderedDict

_NAME = re.compile(r"[A-Za-z0-9_-]{22}\.png")


class ImageStore:
    """In the gateway's memory; single-threaded asyncio use."""

    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._images: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # name -> (png, expiry), oldest first
        self._bytes = 0

    def put(self, png: bytes) -> str:
        """Keep `png`; its file name (128 random bits)."""
        self.expire()
        name = secrets.token_urlsafe(16) + ".png"
        self._images[name] = (png, time.monotonic() + self._ttl_s)
        self._bytes += len(png)
        while self._bytes > self._max_bytes and len(self._images) > 1:
            self._drop(next(iter(self._images)))
        return name

    def get(self, name: str) -> bytes | None:
        """The PNG under `name` while it lasts; None for an unknown, expired or malformed name."""
        if not _NAME.fullmatch(name):
            return None
        self.expire()
        kept = self._images.get(name)
        return kept[0] if kept is not None else None

    def expire(self) -> None:
        """Drop the images whose time has passed (oldest first)."""
        now = time.monotonic()
        while self._images and next(iter(self._images.values()))[1] <= now:
            self._drop(next(iter(self._images)))

    def _drop(self, name: str) -> None:
        png, _ = self._images.pop(name)
        self._bytes -= len(png)
