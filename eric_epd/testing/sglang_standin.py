"""SglangServerStandIn: the HTTP face of an SGLang server (prefill or decode), for gateway routing tests only.

SGLang cannot run a model on this CPU; this stand-in answers OpenAI chat completions with a fixed text naming
itself and records every request body it got (GET /requests), so tests see which instance was asked what.
Run: python -m eric_epd.testing.sglang_standin --port P --name NAME
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def create_app(name: str, delay_s: float) -> FastAPI:
    """The stand-in's app: health, models, chat completions (plain or streamed), plus /requests and /fail."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []
    failing = {"on": False}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "standin", "object": "model", "owned_by": name}]})

    @app.get("/requests")
    async def requests() -> JSONResponse:
        return JSONResponse(seen)

    @app.post("/fail")
    async def fail(request: Request) -> JSONResponse:
        failing["on"] = bool((await request.json())["on"])
        return JSONResponse(failing)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        seen.append(body)
        text = f"answer from {name}"
        if body.get("stream") and not failing["on"]:  # as SGLang: a stream's headers at once, its tokens later
            return StreamingResponse(_stream(text, delay_s), media_type="text/event-stream")
        await asyncio.sleep(delay_s)  # a decode waits for its KV, a prefill computes it
        if failing["on"]:
            return JSONResponse({"object": "error", "message": f"{name} failing", "code": 500}, 500)
        return JSONResponse(
            {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "standin",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    return app


async def _stream(text: str, delay_s: float):  # -> AsyncIterator[bytes]
    await asyncio.sleep(delay_s)  # a decode waits for its KV
    for word in text.split(" "):
        chunk = {
            "id": "chatcmpl-standin",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "standin",
            "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}],
        }
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


def main() -> None:
    """Serve a stand-in on 127.0.0.1 under the name and delay the flags give."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True, help="HTTP port")
    p.add_argument("--name", required=True, help="the model name it answers with")
    p.add_argument(
        "--delay",
        type=float,
        default=0.0,
        help="seconds before answering (a stream sends its headers at once, its tokens after the delay)",
    )
    a = p.parse_args()
    uvicorn.run(
        create_app(a.name, a.delay), host="127.0.0.1", port=a.port, log_level="warning", proxy_headers=False
    )  # the peer is the connecting address, whatever headers say


if __name__ == "__main__":
    main()
