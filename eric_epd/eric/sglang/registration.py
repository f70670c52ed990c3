"""Self-registration with SGLang's encoder bootstrap servers (prefills started without --encoder-urls)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec

from eric_epd.eric.config import SglangConfig
from eric_epd.wire.sglang import RegisterBody

logger = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}


async def register(client: httpx.AsyncClient, bootstrap: str, url: str, settings: SglangConfig) -> None:
    """SGLang's _register_encoder_url_with_bootstrap: retry a bootstrap until it accepts this Eric's URL."""
    body = msgspec.json.encode(RegisterBody(url=url))
    for attempt in range(1, settings.register_attempts + 1):
        try:
            resp = await client.post(f"{bootstrap}/register_encoder_url", content=body, headers=_JSON)
            if resp.status_code == 200:
                logger.info("registered %s with SGLang bootstrap %s", url, bootstrap)
                return
            logger.warning("SGLang bootstrap %s answered %d: %s", bootstrap, resp.status_code, resp.text[:200])
        except httpx.HTTPError as e:
            logger.debug("register attempt %d with %s failed: %r", attempt, bootstrap, e)
        await asyncio.sleep(settings.register_retry_s)
    logger.error(
        "giving up registering with SGLang bootstrap %s after %d attempts", bootstrap, settings.register_attempts
    )


async def unregister(client: httpx.AsyncClient, url: str, settings: SglangConfig) -> None:
    """Withdraw this Eric's URL from every SGLang bootstrap server (best effort, at shutdown)."""
    body = msgspec.json.encode(RegisterBody(url=url))
    for bootstrap in settings.register_urls:
        try:
            await client.request(
                "DELETE", f"{bootstrap}/unregister_encoder_url", content=body, headers=_JSON, timeout=2.0
            )
        except httpx.HTTPError as e:
            logger.debug("unregister from %s failed: %r", bootstrap, e)
