"""HTTP helpers shared by Eric's router and the gateway."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from eric_epd.common.errors import error_response


def bearer(api_key: str | None) -> dict[str, str]:
    """The Authorization header that carries `api_key` (none when no key is configured)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def key_matches(headers: Headers, api_key: str) -> bool:
    """Constant-time check of 'Authorization: Bearer KEY'."""
    given = headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def unauthorized() -> JSONResponse:
    """401 in the JSON error shape every route answers with."""
    return error_response(401, "missing or wrong API key (send 'Authorization: Bearer KEY')")


class ApiKeyMiddleware:
    """Pure ASGI: every HTTP request outside `open_paths` must carry the API key (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry: answer 401 to an HTTP request outside `open_paths` without the key, else pass it on."""
        if (
            scope["type"] == "http"
            and scope["path"] not in self.open_paths
            and not key_matches(Headers(scope=scope), self.api_key)
        ):
            await unauthorized()(scope, receive, send)
            return
        await self.app(scope, receive, send)
