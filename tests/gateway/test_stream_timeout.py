"""A streaming client that stops reading (a real socket that never reads) has its stream closed after the write
timeout, and the upstream side released (the body iterator's aclose ran); one that keeps its stream without the
bound holds it (negative control). The gateway's own TimedStream, served by uvicorn."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from epd_gateway.stream import TimedStream
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from eric_epd.stack.process import free_port


class _Upstream:
    """An endless SSE source whose aclose marks `released` (as the gateway's relay releases vLLM's stream)."""

    def __init__(self, released: threading.Event) -> None:
        self._released = released

    def __aiter__(self) -> _Upstream:
        return self

    async def __anext__(self) -> bytes:
        return b"data: " + b"x" * 65536 + b"\n\n"

    async def aclose(self) -> None:
        self._released.set()


def _serve(write_timeout_s: float, released: threading.Event) -> tuple[uvicorn.Server, int]:
    async def stream(_: Request) -> TimedStream:
        return TimedStream(_Upstream(released), 200, {"content-type": "text/event-stream"}, write_timeout_s)

    port = free_port()
    app = Starlette(routes=[Route("/stream", stream)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return server, port


def _stalled_reader(port: int) -> socket.socket:
    """Asks for the stream, reads its first bytes, then never reads again (a small receive buffer fills fast)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    return sock


def _held(write_timeout_s: float, wait_s: float) -> bool:
    released = threading.Event()
    server, port = _serve(write_timeout_s, released)
    sock = _stalled_reader(port)
    try:
        return not released.wait(wait_s)
    finally:
        sock.close()
        server.should_exit = True


def test_a_client_that_stops_reading_loses_its_stream_and_the_upstream_is_released() -> None:
    assert not _held(write_timeout_s=0.5, wait_s=60)


def test_without_the_bound_the_stalled_client_holds_the_upstream() -> None:
    assert _held(write_timeout_s=3600, wait_s=3)
