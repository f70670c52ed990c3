"""Leases given back: the one owner of an EPD request's leases (`Leases`, a scope that gives every lease back on any
error or cancellation unless the engine took them), and the acks that free an Eric's rows now instead of at their
TTL."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

import httpx

from epd_gateway.content import soundtracks
from eric_epd.wire.handles import ack_request, is_content_hash

logger = logging.getLogger(__name__)


class Leases:
    """One request's leases, from the Erics' answers until the engine answers: `hold` what an encode returns,
    `give_back` what no engine will fetch, `hand_over` once the engine took them (a 2xx); leaving the scope gives
    back, shielded from cancellation, everything still held."""

    def __init__(self, client: httpx.AsyncClient, knows: Callable[[str], bool]) -> None:
        self._client = client
        self._knows = knows
        self._held: dict[str, dict[str, Any]] = {}  # lease token -> handle
        self._handed = False

    def hold(self, items: list[dict[str, Any]]) -> None:
        """These items' leases (their soundtracks' too) are this request's from now on."""
        self._held.update(_handles(items))

    async def give_back(self, items: list[dict[str, Any]]) -> None:
        """Give these items' leases back now (shielded: a client leaving meanwhile does not stop it)."""
        handles = {lease: self._held.pop(lease) for lease in _handles(items) if lease in self._held}
        await asyncio.shield(self._ack(list(handles.values())))

    def hand_over(self) -> None:
        """The engine answered with these leases (2xx): it acknowledges them; nothing is given back here."""
        self._handed = True

    async def __aenter__(self) -> Leases:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        if not self._handed and self._held:
            handles, self._held = list(self._held.values()), {}
            await asyncio.shield(self._ack(handles))

    async def _ack(self, handles: list[dict[str, Any]]) -> None:
        await release_leases(self._client, self._knows, handles)


def _handles(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["handle"]["lease"]: item["handle"] for item in [*items, *soundtracks(items)]
            if isinstance(item.get("handle"), dict) and "lease" in item["handle"]}


async def release_leases(client: httpx.AsyncClient, knows: Callable[[str], bool],
                         handles: list[dict[str, Any]]) -> None:
    """Ack every lease of `handles`. Best effort: a failure only leaves the TTL to act. An ack goes only to a producer
    `knows` accepts (an Eric the gateway knows), never to a URL an answer names."""

    async def ack(handle: dict[str, Any]) -> None:
        producer = str(handle.get("producer", "")).rstrip("/")
        if not knows(producer) or not is_content_hash(str(handle.get("hash", ""))):
            logger.warning("not acknowledging an embedding at %r: not an Eric this gateway knows", producer[:200])
            return
        try:
            request = ack_request(producer, handle["hash"], handle["lease"], handle.get("instance_id"))
            await client.post(request.url, headers=request.headers, content=request.content, timeout=2.0)
        except (httpx.HTTPError, KeyError) as e:
            logger.debug("releasing %s failed: %r", handle.get("hash"), e)

    await asyncio.gather(*(ack(handle) for handle in handles))
