"""Stand-ins for tests of what the gateway trusts: a proxy Eric in front of a real one (it may lie about its load, hold
encode calls until released, or name another producer in its answers), an HTTP listener that counts what reaches it,
and an engine that reads and acknowledges the embeddings handed to it; real servers on loopback, in threads."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from eric_epd.common.errors import error_response
from eric_epd.stack.process import free_port
from eric_epd.testing.stack import wait_for


class _ThreadServer:
    """A Starlette app served by uvicorn on 127.0.0.1 in a daemon thread, around a `with` block."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", proxy_headers=False)
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        if not wait_for(lambda: self._server.started, 30.0, 0.05):
            raise TimeoutError(f"stand-in server on {self.url} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)


class ProxyEric(_ThreadServer):
    """Forwards every route to the Eric at `backend`, except GET /v1/load when `load` is given (answered as is).
    `hold`: /v1/encode calls wait until release(). `producer`: each answered handle names this producer instead.
    `card=False`: its model card (GET /v1/models) cannot be read (503). `received` and `answered` count the items of
    the encode calls that arrived and that were answered; `asked` counts the calls by path."""

    def __init__(
        self,
        backend: str,
        load: dict[str, Any] | None = None,
        hold: bool = False,
        producer: str | None = None,
        card: bool = True,
    ) -> None:
        self._backend, self._load, self._producer, self._card = backend, load, producer, card
        self.asked: Counter[str] = Counter()
        self._open = threading.Event()
        if not hold:
            self._open.set()
        self.received = 0
        self.answered = 0
        super().__init__(
            Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "DELETE", "PUT"])])
        )

    def release(self) -> None:
        """Let the held encode calls (and later ones) go on."""
        self._open.set()

    async def _forward(self, request: Request) -> Response:
        path = request.url.path
        self.asked[path] += 1
        if path == "/v1/load" and self._load is not None:
            return JSONResponse(self._load)
        if path == "/v1/models" and not self._card:
            return error_response(503, "the card cannot be read (stand-in)")
        body = await request.body()
        items = len(orjson.loads(body)["items"]) if path == "/v1/encode" else 0
        self.received += items
        if items:
            await asyncio.to_thread(self._open.wait)
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type", "x-eric-lease")}
        async with httpx.AsyncClient(timeout=120) as client:
            resp = await client.request(
                request.method, self._backend + path, params=request.query_params, content=body, headers=headers
            )
        content = resp.content
        if items and resp.status_code == 200:
            self.answered += items
            if self._producer is not None:
                answer = orjson.loads(content)
                for item in answer["items"]:
                    item["handle"]["producer"] = self._producer
                content = orjson.dumps(answer)
        return Response(
            content, status_code=resp.status_code, media_type=resp.headers.get("content-type", "application/json")
        )


class CountingListener(_ThreadServer):
    """Answers every request 200 with `{}` and counts them by path (`requests`)."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        super().__init__(
            Starlette(routes=[Route("/{path:path}", self._answer, methods=["GET", "POST", "DELETE", "PUT"])])
        )

    async def _answer(self, request: Request) -> Response:
        self.requests[request.url.path] += 1
        return JSONResponse({})


class EmbedsEngine(_ThreadServer):
    """A colocated engine behind the gateway that does with handed embeddings what vLLM's connector does: each
    handle in a chat request's vllm_xargs is read over HTTP with its lease (the Erics' `api_key`), then
    acknowledged. `handles` lists every handle received; `read` maps each content hash to the bytes read."""

    def __init__(self, api_key: str) -> None:
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self.handles: list[dict[str, Any]] = []
        self.read: dict[str, bytes] = {}
        super().__init__(
            Starlette(
                routes=[
                    Route("/v1/chat/completions", self._chat, methods=["POST"]),
                    Route("/{path:path}", self._other, methods=["GET", "POST"]),
                ]
            )
        )

    async def _chat(self, request: Request) -> Response:
        from eric_epd.wire.handles import LEASE_HEADER, ack_request
        from eric_epd.wire.handoff import EXTRA_ARGS_KEY

        body = orjson.loads(await request.body())
        handles = orjson.loads((body.get("vllm_xargs") or {}).get(EXTRA_ARGS_KEY, "[]"))
        async with httpx.AsyncClient(timeout=30) as client:
            for h in handles:
                self.handles.append(h)
                lease = self._headers | {LEASE_HEADER: h["lease"]}
                got = await client.get(h["http"], headers=lease)
                request = ack_request(h["producer"], h["hash"], h["lease"], h["instance_id"])
                ack = await client.post(request.url, headers=self._headers | request.headers, content=request.content)
                if got.status_code != 200 or ack.status_code != 200:
                    return error_response(500, f"embedding {h['hash'][:12]} unreadable")
                self.read[h["hash"]] = got.content
        return JSONResponse(
            {
                "id": "chatcmpl-stand-in",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
            }
        )

    async def _other(self, request: Request) -> Response:
        return JSONResponse({})


def process_group_cmdlines(pid: int) -> list[str]:
    """The command lines (argv joined by spaces) of every process in `pid`'s process group, as `ps` shows them."""
    from eric_epd.stack.process import group_pids

    found = []
    for member in group_pids(pid):
        try:
            with open(f"/proc/{member}/cmdline", "rb") as f:
                found.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone meanwhile
            continue
    return found
