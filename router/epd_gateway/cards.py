"""Reading each Eric's /v1/models card (its modalities and where the engine places its items): one read in flight
per Eric however many wait for it, bounded by a short timeout, retried later when it fails."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

import httpx

from epd_gateway.members import CARD_RETRY_S, CARD_TIMEOUT_S, EncoderState
from eric_epd.wire.eric import decode_card

logger = logging.getLogger(__name__)


class CardReader:
    """Reads the cards of the pool's members into their EncoderState."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._reads: dict[str, asyncio.Future[None]] = {}  # url -> the one read in flight for it

    @staticmethod
    def due(member: EncoderState) -> bool:
        """Whether the member's card is unread and may be read now (not within CARD_RETRY_S of a failed read)."""
        return member.modalities is None and time.monotonic() >= member.card_after

    def read_once(self, member: EncoderState) -> Awaitable[None]:
        """The read in flight for `member`, started if none is; a waiter that leaves does not end it."""
        flight = self._reads.get(member.url)
        if flight is None:
            flight = self._reads[member.url] = asyncio.ensure_future(self._read(member))
            flight.add_done_callback(lambda _: self._reads.pop(member.url, None))
        return asyncio.shield(flight)

    async def _read(self, member: EncoderState) -> None:
        try:
            resp = await self._client.get(f"{member.url}/v1/models", timeout=CARD_TIMEOUT_S)
            resp.raise_for_status()
            card = decode_card(resp.content)
        except Exception as e:  # unknown for now (e.g. still starting): the encode call decides; read again later
            logger.warning("encoder %s: cannot read its model card: %r", member.url, e)
            member.card_after = time.monotonic() + CARD_RETRY_S
            return
        member.modalities, member.placement, member.takes_audio = (
            frozenset(card.modalities),
            card.placement,
            card.takes_audio,
        )
