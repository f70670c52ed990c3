"""ZMQ PUSH of part messages to SGLang's receivers, zero-copy from the pool: a send returns only once ZMQ no
longer reads the frames."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import zmq
import zmq.asyncio

from eric_epd.plugins.sglang.protocol import tcp_endpoint


class ZmqSender:
    """One context; one cached socket per scheduler-rank endpoint, a fresh one for one-shot tokenizer pushes."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._zmq = zmq.asyncio.Context()
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def push(self, endpoint: str, frames: list[Any], cached: bool) -> None:
        """Send one message to "host:port"; returns once ZMQ no longer reads `frames` (they may point into the pool)."""
        address = tcp_endpoint(endpoint)
        if cached:
            await self._push_cached(address, frames)
        else:
            await self._push_once(address, frames)

    async def _push_once(self, address: str, frames: list[Any]) -> None:
        sock = self._socket(address)
        tracker = None
        try:
            tracker = await asyncio.wait_for(sock.send_multipart(frames, copy=False, track=True), self.timeout_s)
            await asyncio.to_thread(tracker.wait, self.timeout_s)
        except BaseException:
            sock.close(linger=0)  # drop what was queued: its frames may point into the pool
            if tracker is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(tracker.wait, 1.0)
            raise
        sock.close(linger=5000)

    async def _push_cached(self, address: str, frames: list[Any]) -> None:
        async with self._locks.setdefault(address, asyncio.Lock()):
            sock = self._sockets.get(address)
            if sock is None:
                sock = self._sockets[address] = self._socket(address)
            try:
                tracker = await asyncio.wait_for(sock.send_multipart(frames, copy=False, track=True), self.timeout_s)
            except BaseException:
                self._sockets.pop(address, None)
                sock.close(linger=0)
                raise
        await asyncio.to_thread(tracker.wait, self.timeout_s)

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(address)
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._zmq.term()
