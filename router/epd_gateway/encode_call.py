"""One call to an Eric's POST /v1/encode: the body naming each item by its place in the client's request, the timed
POST, and the answers about the client's media that the gateway passes on instead of failing over."""

from __future__ import annotations

import logging
import time

import aiohttp
import msgspec

from epd_gateway.content import MediaRef
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.upstream import RETRY_ONCE, Reply, pooled_session
from eric_epd.common.errors import ApiError
from eric_epd.wire.eric import EncodedItem, EncodeItem, encode_body

logger = logging.getLogger(__name__)
CLIENT_ERRORS = (400, 415, 422)
"""An Eric's answers about the client's media: passed on (any other 4xx, e.g. a wrong key or a limit of that Eric,
fails over like a 5xx)."""


def encode_request(refs: list[MediaRef]) -> bytes:
    """The /v1/encode body for these items, each named by its place in the client's request (which Eric's errors
    about it then quote)."""
    return encode_body(
        [EncodeItem(id=_item_id(r), modality=r.modality, url=r.url, use_audio_in_video=r.with_audio) for r in refs]
    )


def _item_id(ref: MediaRef) -> str:
    return f"messages[{ref.message}].content[{ref.part}]"


def answer_problem(items: list[EncodedItem], refs: list[MediaRef]) -> str | None:
    """Why an Eric's answer does not answer these items, one each in order (its ids and modalities), or None: an
    answer of another shape would put one item's embedding in another's place."""
    got = [(i.id, i.modality) for i in items]
    if got != [(_item_id(r), r.modality) for r in refs]:
        return f"answered {len(items)} items {msgspec.json.encode(got)[:200]!r} for {len(refs)} asked"
    return None


def new_encoder_session(headers: dict[str, str]) -> aiohttp.ClientSession:
    """The session the encode calls take (aiohttp, as the engine calls: measured here, an httpx POST cost 0.41 ms of
    the gateway's CPU against aiohttp's 0.10), `headers` (the Erics' key) on every call; each call sets its own
    total timeout."""
    return pooled_session(aiohttp.ClientTimeout(total=None, connect=10.0), headers)


async def post_encode(
    session: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float, metrics: GatewayMetrics
) -> Reply:
    """POST /v1/encode and read the answer (whole, within `timeout_s`); the time to its headers is
    gateway_upstream_seconds{encoder}. A pooled connection the Eric had closed is retried once on a fresh one.
    Raises aiohttp.ClientError or TimeoutError when the Eric cannot be reached or answers too slowly."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"content-type": "application/json"}
    start = time.perf_counter()
    try:
        resp = await session.post(f"{url}/v1/encode", data=body, headers=headers, timeout=timeout)
    except RETRY_ONCE as e:
        logger.info("retrying the encode call to %s on a fresh connection after %r", url, e)
        resp = await session.post(f"{url}/v1/encode", data=body, headers=headers, timeout=timeout)
    metrics.upstreams.observe("encoder", time.perf_counter() - start)
    async with resp:
        return Reply(resp.status, await resp.read(), {k.lower(): v for k, v in resp.headers.items()})


def media_rejected(resp: Reply) -> ApiError:
    """The error passed on to the client for an Eric's answer in CLIENT_ERRORS (its message, or the body's start)."""
    try:
        message = msgspec.json.decode(resp.body)["error"]["message"]
    except Exception:
        message = resp.body[:300].decode(errors="replace")
    return ApiError(resp.status, f"media rejected by encoder: {message}")
