"""Leases given back: the one owner of an EPD request's leases (`Leases`, a scope that gives every lease back on any
error or cancellation unless the engine took them), and the acks that free an Eric's rows now instead of at their
TTL."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType

import httpx

from epd_gateway.content import soundtracks
from eric_epd.wire.eric import EncodedItem
from eric_epd.wire.handles import EmbeddingHandle, ack_request, is_content_hash

logger = logging.getLogger(__name__)


class Leases:
    """One request's leases, from the Erics' answers until the engine answers: `hold` what an encode returns,
    `give_back` what no engine will fetch, `hand_over` once the engine took them (a 2xx); leaving the scope gives
    back, shielded from cancellation, everything still held."""

    def __init__(self, client: httpx.AsyncClient, vouch: Callable[[str], Awaitable[bool]]) -> None:
        self._client = client
        self._vouch = vouch
        self._held: dict[str, EmbeddingHandle] = {}  # lease token -> handle
        self._handed = False

    def hold(self, items: list[EncodedItem]) -> None:
        """These items' leases (their soundtracks' too) are this request's from now on."""
        for item in [*items, *soundtracks(items)]:
            self._held[item.handle.lease] = item.handle

    async def give_back(self, handles: list[EmbeddingHandle]) -> None:
        """Give these leases back now (shielded: a client leaving meanwhile does not stop it)."""
        back = {h.lease: self._held.pop(h.lease) for h in handles if h.lease in self._held}
        await asyncio.shield(self._ack(list(back.values())))

    def hand_over(self) -> None:
        """The engine answered with these leases (2xx): it acknowledges them; nothing is given back here."""
        self._handed = True

    async def __aenter__(self) -> Leases:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if not self._handed and self._held:
            handles, self._held = list(self._held.values()), {}
            await asyncio.shield(self._ack(handles))

    async def _ack(self, handles: list[EmbeddingHandle]) -> None:
        await release_leases(self._client, self._vouch, handles)


async def release_leases(
    client: httpx.AsyncClient, vouch: Callable[[str], Awaitable[bool]], handles: list[EmbeddingHandle]
) -> None:
    """Ack every lease of `handles`. Best effort: a failure only leaves the TTL to act. An ack (it carries the Erics'
    key) goes only to a producer `vouch` accepts (Encoders.vouch: an Eric the gateway knows still holds that address),
    never to a URL an answer names."""

    async def ack(handle: EmbeddingHandle) -> None:
        producer = handle.producer.rstrip("/")
        if not is_content_hash(handle.hash) or not await vouch(producer):
            logger.warning("not acknowledging an embedding at %r: not an Eric this gateway knows", producer[:200])
            return
        try:
            request = ack_request(producer, handle.hash, handle.lease, handle.instance_id)
            await client.post(request.url, headers=request.headers, content=request.content, timeout=2.0)
        except httpx.HTTPError as e:
            logger.debug("releasing %s failed: %r", handle.hash, e)

    await asyncio.gather(*(ack(handle) for handle in handles))
