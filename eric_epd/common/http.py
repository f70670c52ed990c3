"""HTTP helpers shared by Eric's router and the gateway."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send


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


def bearer(api_key: str | None) -> dict[str, str]:
    """The Authorization header that carries `api_key` (none when no key is configured)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def key_matches(headers: Headers, api_key: str) -> bool:
    """Constant-time check of 'Authorization: Bearer KEY'."""
    given = headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def unauthorized() -> JSONResponse:
    """401 in the JSON error shape every route answers with."""
    return JSONResponse({"error": {"message": "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                   "type": "AuthenticationError", "param": None, "code": 401}}, 401)


class ApiKeyMiddleware:
    """Pure ASGI: every HTTP request outside `open_paths` must carry the API key (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry: answer 401 to an HTTP request outside `open_paths` without the key, else pass it on."""
        if (scope["type"] == "http" and scope["path"] not in self.open_paths
                and not key_matches(Headers(scope=scope), self.api_key)):
            await unauthorized()(scope, receive, send)
            return
        await self.app(scope, receive, send)
