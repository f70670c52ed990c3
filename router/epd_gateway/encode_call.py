"""One call to an Eric's POST /v1/encode: the body naming each item by its place in the client's request, the timed
POST, and the answers about the client's media that the gateway passes on instead of failing over."""

from __future__ import annotations

import time

import httpx

from epd_gateway.content import MediaRef
from epd_gateway.metrics import GatewayMetrics
from eric_epd.common.errors import ApiError
from eric_epd.wire.eric import EncodeItem, encode_body

CLIENT_ERRORS = (400, 415, 422)
"""An Eric's answers about the client's media: passed on (any other 4xx, e.g. a wrong key or a limit of that Eric,
fails over like a 5xx)."""


def encode_request(refs: list[MediaRef]) -> bytes:
    """The /v1/encode body for these items, each named by its place in the client's request (which Eric's errors
    about it then quote)."""
    return encode_body(
        [
            EncodeItem(
                id=f"messages[{r.message}].content[{r.part}]",
                modality=r.modality,
                url=r.url,
                use_audio_in_video=r.with_audio,
            )
            for r in refs
        ]
    )


async def post_encode(
    client: httpx.AsyncClient, url: str, body: bytes, timeout_s: float, metrics: GatewayMetrics
) -> httpx.Response:
    """POST /v1/encode and read the answer; the time to its headers is gateway_upstream_seconds{encoder}."""
    request = client.build_request(
        "POST", f"{url}/v1/encode", content=body, timeout=timeout_s, headers={"content-type": "application/json"}
    )
    start = time.perf_counter()
    resp = await client.send(request, stream=True)
    metrics.upstreams.observe("encoder", time.perf_counter() - start)
    try:
        await resp.aread()
    finally:
        await resp.aclose()
    return resp


def media_rejected(resp: httpx.Response) -> ApiError:
    """The error passed on to the client for an Eric's answer in CLIENT_ERRORS (its message, or the body's start)."""
    try:
        message = resp.json()["error"]["message"]
    except Exception:
        message = resp.text[:300]
    return ApiError(resp.status_code, f"media rejected by encoder: {message}")
