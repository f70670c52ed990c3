"""`vllm serve --middleware eric_epd.plugins.vllm.middleware.refuse_unkeyed_metadata`: a 400 for chat content parts
that carry embedding metadata (e.g. only a grid) but neither the embedding nor a uuid; vLLM 0.32's engine dies on
those, and without a uuid no Eric could serve them anyway."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from eric_epd.common.errors import error_response

_EMBED_PARTS = ("image_embeds", "video_embeds", "audio_embeds")


def find_unkeyed_metadata(body: Any) -> str | None:
    """A message naming the first metadata-only content part without a uuid, or None."""
    if not isinstance(body, dict):
        return None
    for m, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _EMBED_PARTS:
                continue
            kind = part["type"]
            payload = part.get(kind)
            carries_tensor = isinstance(payload, str) or (isinstance(payload, dict) and kind in payload)
            if not carries_tensor and not part.get("uuid"):
                return (f"messages[{m}].content[{p}]: a {kind} part with metadata only needs a 'uuid' "
                        "(the Eric content hash) so the embedding can be found; send the embedding or the uuid")
    return None


async def refuse_unkeyed_metadata(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """vLLM middleware: 400 for a chat request whose embedding part has metadata but neither tensor nor uuid."""
    if request.method == "POST" and request.url.path.endswith("/chat/completions"):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return await call_next(request)  # vLLM answers malformed JSON itself
        problem = find_unkeyed_metadata(body)
        if problem is not None:
            return error_response(400, problem)
    return await call_next(request)
