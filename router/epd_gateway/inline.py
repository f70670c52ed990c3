"""Media for the engines' own path: the gateway fetches each remote item itself (the one URL policy that checks the
address at connect time and every redirect) and hands vLLM or SGLang a ``data:`` URL, so no engine fetches a URL."""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
from typing import Any

from epd_gateway.content import MediaRef
from eric_epd.common.errors import ApiError
from eric_epd.media.fetch import MediaFetcher
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError, UrlPolicy, url_scheme

logger = logging.getLogger(__name__)

FETCHED_SCHEMES = frozenset({"http", "https", "file"})
"""What an engine would have to fetch (or read) itself; data: URLs already carry their bytes."""


class MediaInliner:
    """One per gateway process: an httpx client behind the URL policy, reused across requests."""

    def __init__(self, policy: UrlPolicy, limits: MediaLimits) -> None:
        self._fetcher = MediaFetcher(policy, limits)

    async def aclose(self) -> None:
        """Close the media fetcher's HTTP client."""
        await self._fetcher.aclose()

    async def inline(self, body: dict[str, Any], refs: list[MediaRef]) -> dict[str, Any] | None:
        """A copy of the request whose remote media parts are data: URLs, or None when it has none (the client's
        raw body can then go as it is). A fetch the policy refuses or that fails is the client's 4xx."""
        remote = [ref for ref in refs if url_scheme(ref.url) in FETCHED_SCHEMES]
        if not remote:
            return None
        fetched = await asyncio.gather(*(self._fetch(ref) for ref in remote))
        out = dict(body)
        out["messages"] = copy.deepcopy(body["messages"])
        for ref, data in zip(remote, fetched, strict=True):
            part = out["messages"][ref.message]["content"][ref.part]
            kind = ref.part_type  # an image_url, video_url or audio_url part (input_audio parts carry their data)
            url = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
            payload = part[kind]
            part[kind] = {**payload, "url": url} if isinstance(payload, dict) else {"url": url}
        return out

    async def _fetch(self, ref: MediaRef) -> bytes:
        try:
            return await self._fetcher.fetch(ref.url)
        except MediaError as e:
            where = f"messages[{ref.message}].content[{ref.part}]"
            raise ApiError(e.status if e.status < 500 else 400, f"{where}: {e.message}") from e


class RawBody:
    """The client's request as the engines' own path sends it, media inlined on first need and then reused (an EPD
    request that falls back does not fetch twice)."""

    def __init__(self, inliner: MediaInliner, body: dict[str, Any], raw: bytes, refs: list[MediaRef]) -> None:
        self._inliner = inliner
        self._body = body
        self._raw = raw
        self._refs = refs
        self._inlined: tuple[dict[str, Any], bytes | None] | None = None

    @property
    def refs(self) -> list[MediaRef]:
        """The request's media items."""
        return self._refs

    async def get(self) -> tuple[dict[str, Any], bytes | None]:
        """(body, raw bytes to forward or None to re-encode the body)."""
        if self._inlined is None:
            inlined = await self._inliner.inline(self._body, self._refs)
            self._inlined = (self._body, self._raw) if inlined is None else (inlined, None)
        return self._inlined
