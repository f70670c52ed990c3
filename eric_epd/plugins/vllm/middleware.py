"""`vllm serve --middleware eric_epd.plugins.vllm.middleware.RefuseUnkeyedMetadata`: the engine key first, then a 400
for chat content parts that carry embedding metadata (e.g. only a grid) but neither the embedding nor a uuid; vLLM
0.32's engine dies on those, and without a uuid no Eric could serve them anyway."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from eric_epd.common.errors import OFF_LOOP_BYTES, error_response
from eric_epd.plugins.vllm.auth import RequireEngineKey

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
                return (
                    f"messages[{m}].content[{p}]: a {kind} part with metadata only needs a 'uuid' "
                    "(the Eric content hash) so the embedding can be found; send the embedding or the uuid"
                )
    return None


def _may_name_embeds(body: bytes) -> bool:
    """Whether the JSON `body` may hold an embeds part: it names one in UTF-8, or could spell one otherwise (\\u
    escapes, or UTF-16 or UTF-32, which json.loads reads as vLLM does)."""
    if json.detect_encoding(body) != "utf-8" or b"\\u" in body:
        return True
    return any(kind.encode() in body for kind in _EMBED_PARTS)


def _problem_in(body: bytes) -> str | None:
    """find_unkeyed_metadata of the parsed body; None if it is not JSON (vLLM answers that itself)."""
    try:
        return find_unkeyed_metadata(json.loads(body))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None


class RefuseUnkeyedMetadata(RequireEngineKey):
    """vLLM middleware: the engine key checked first (as RequireEngineKey), whatever order the middlewares are given
    in; then a 400 for a chat request whose embedding part has metadata but neither tensor nor uuid. An unkeyed
    caller's body is never read."""

    def __call__(self, scope: Scope, receive: Receive, send: Send):  # -> Awaitable[None]
        """ASGI entry: a keyed POST to a chat route is read, checked and replayed; anything else as RequireEngineKey."""
        chat = scope["type"] == "http" and scope.get("method") == "POST" and scope["path"].endswith("/chat/completions")
        if not chat or not self.verify_token(Headers(scope=scope)):
            return super().__call__(scope, receive, send)
        return self._check_chat(scope, receive, send)

    async def _check_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        problem = None  # no embeds part can be in it: nothing to parse (vLLM answers malformed JSON itself)
        if _may_name_embeds(body):
            problem = await asyncio.to_thread(_problem_in, body) if len(body) > OFF_LOOP_BYTES else _problem_in(body)
        if problem is not None:
            await error_response(400, problem)(scope, receive, send)
            return
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)
