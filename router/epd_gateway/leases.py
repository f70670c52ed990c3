"""Leases given back: an encode's items that no engine will fetch are acknowledged at the Erics that hold them, so
they free the rows now instead of at their TTL."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from epd_gateway.content import soundtracks
from eric_epd.wire.handles import LEASE_HEADER, AckBody, is_content_hash

logger = logging.getLogger(__name__)


async def release_leases(client: httpx.AsyncClient, knows: Callable[[str], bool], items: list[dict[str, Any]]) -> None:
    """Ack every lease the items (and their soundtracks) hold. Best effort: a failure only leaves the TTL to act. An
    ack goes only to a producer `knows` accepts (an Eric the gateway knows), never to a URL an answer names."""

    async def ack(handle: dict[str, Any]) -> None:
        producer = str(handle.get("producer", "")).rstrip("/")
        if not knows(producer) or not is_content_hash(str(handle.get("hash", ""))):
            logger.warning("not acknowledging an embedding at %r: not an Eric this gateway knows", producer[:200])
            return
        try:
            await client.post(f"{producer}/v1/embeddings/{handle['hash']}/ack", timeout=2.0,
                              content=msgspec.json.encode(AckBody(handle["instance_id"])),
                              headers={LEASE_HEADER: handle["lease"]})
        except (httpx.HTTPError, KeyError) as e:
            logger.debug("releasing %s failed: %r", handle.get("hash"), e)

    handles = {item["handle"]["lease"]: item["handle"] for item in [*items, *soundtracks(items)]
               if isinstance(item.get("handle"), dict)}
    await asyncio.gather(*(ack(handle) for handle in handles.values()))
