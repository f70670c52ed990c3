"""HTTP helpers shared by Eric's router and the gateway."""

from __future__ import annotations

from starlette.requests import Request


class BodyTooLargeError(Exception):
    """The request body is over the limit (answer 413)."""


async def read_limited_body(request: Request, limit: int) -> bytes:
    """The request body, refused (BodyTooLargeError) past `limit` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
