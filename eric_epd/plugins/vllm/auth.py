"""`vllm serve --middleware eric_epd.plugins.vllm.auth.RequireEngineKey`: every route of the engine but health and
metrics answers only callers holding its key (VLLM_API_KEY), where vLLM's own --api-key guards four prefixes only
and leaves `/invocations`, `/pooling`, `/tokenize` and any route added later open."""

from __future__ import annotations

import os

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from eric_epd.common.errors import error_response

OPEN_ROUTES = frozenset({"/health", "/metrics"})
"""What an unkeyed caller (a load balancer's or Prometheus's probe) may GET."""


class RequireEngineKey(AuthenticationMiddleware):
    """vLLM's bearer check (constant-time, on a hash of the token) applied to every HTTP and WebSocket route but a
    GET of OPEN_ROUTES. The gateway is the only holder of the key, so no stranger can hand the engine embedding
    parts, uuids or steering fields by any route."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get("VLLM_API_KEY")
        if not key:
            raise RuntimeError("RequireEngineKey needs VLLM_API_KEY: the key the gateway sends this engine")
        super().__init__(app, [key])

    def __call__(self, scope: Scope, receive: Receive, send: Send):  # -> Awaitable[None]
        """ASGI entry: non-HTTP traffic and GETs of `OPEN_ROUTES` pass; anything else needs the engine key (401)."""
        if scope["type"] not in ("http", "websocket"):
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_ROUTES and scope.get("method") in ("GET", "HEAD"):
            return self.app(scope, receive, send)
        if not self.verify_token(Headers(scope=scope)):
            message = "this engine answers only its gateway: the engine key is missing or wrong"
            return error_response(401, message)(scope, receive, send)
        return self.app(scope, receive, send)
