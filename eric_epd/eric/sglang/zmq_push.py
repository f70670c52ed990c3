"""ZMQ PUSH of part messages to SGLang's receivers, zero-copy from the pool: a send returns, or raises, only once
ZMQ no longer reads the frames, so the caller may then reuse their region. Cached sockets per receiver are bounded
in number and closed when idle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from eric_epd.eric.sglang.protocol import SglangError, tcp_endpoint

logger = logging.getLogger(__name__)
STUCK_WARNING_S = 5.0
"""A dropped message whose frames ZMQ still holds after this long is logged (its region stays held meanwhile)."""
ONE_SHOT_SOCKETS = 256
"""One-shot sockets (tokenizer pushes) open at once, over every request; more wait their turn, within the timeout."""


async def all_sent(tasks: list[asyncio.Task[None]]) -> list[BaseException | None]:
    """Each send task's exception (or None), once every one has ended, even if the caller is cancelled meanwhile: a
    send ends only when ZMQ no longer reads its frames, which may point into the pool, and the caller frees their
    region after this. The caller's cancellation cancels the sends, and is raised again once they have ended."""
    cancelled, pending = False, set(tasks)
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
            for task in pending:
                task.cancel()
    if cancelled:
        raise asyncio.CancelledError
    return [asyncio.CancelledError() if t.cancelled() else t.exception() for t in tasks]


async def _sent(tracker: zmq.MessageTracker, timeout_s: float) -> None:
    """Wait until ZMQ has handed the frames to the kernel; TimeoutError after `timeout_s` (a slow or gone receiver)."""
    deadline, pause = time.monotonic() + timeout_s, 1e-4
    while not tracker.done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the receiver took no message for {timeout_s:g} s")
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.02)


async def drop(sock: zmq.asyncio.Socket, tracker: zmq.MessageTracker | None) -> None:
    """Close `sock` discarding whatever it still queues, and return only once ZMQ has let go of the tracked frames:
    they may point into the pool, whose region the caller releases after this. Cancellation is deferred until then
    (a region released under a queued message would send the next owner's bytes)."""
    sock.close(linger=0)
    if tracker is None:
        return
    cancelled, started, warned = False, time.monotonic(), False
    while not tracker.done:
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            cancelled = True
        if not warned and time.monotonic() - started > STUCK_WARNING_S:
            warned = True
            logger.warning(
                "ZMQ still holds a dropped message's frames after %.0f s; its region stays held", STUCK_WARNING_S
            )
    if cancelled:
        raise asyncio.CancelledError


@dataclass
class _Receiver:
    """A cached PUSH socket to one scheduler rank; `users` counts pushes under way (it is closed only at 0)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sock: zmq.asyncio.Socket | None = None
    users: int = 0
    used: float = field(default_factory=time.monotonic)


class ZmqSender:
    """One context; a fresh socket for each one-shot tokenizer push, and a cached one per scheduler-rank endpoint:
    at most `max_receivers` of them (the least recently used idle one is closed to make room; 503 when every one
    is busy), each closed once idle for `idle_s` (`expire`)."""

    def __init__(self, timeout_s: float, max_receivers: int = 1024, idle_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.max_receivers = max_receivers
        self.idle_s = idle_s
        self._zmq = zmq.asyncio.Context()
        self._zmq.set(zmq.MAX_SOCKETS, max_receivers + ONE_SHOT_SOCKETS + 16)  # ZMQ's default: 1023 in all
        self._once = asyncio.Semaphore(ONE_SHOT_SOCKETS)
        self._receivers: OrderedDict[str, _Receiver] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._receivers)

    async def push(self, endpoint: str, frames: list[Any], cached: bool) -> None:
        """Send one message to "host:port"; returns once ZMQ no longer reads `frames` (they may point into the pool)."""
        address = tcp_endpoint(endpoint)
        if cached:
            await self._push_cached(address, frames)
        else:
            await self._push_once(address, frames)

    async def _push_once(self, address: str, frames: list[Any]) -> None:
        try:
            await asyncio.wait_for(self._once.acquire(), self.timeout_s)
        except TimeoutError:
            busy = f"{ONE_SHOT_SOCKETS} pushes under way for {self.timeout_s:g} s; retry later"
            raise SglangError(503, busy) from None
        try:
            sock = self._socket(address)
            tracker = None
            try:
                tracker = await asyncio.wait_for(sock.send_multipart(frames, copy=False, track=True), self.timeout_s)
                await _sent(tracker, self.timeout_s)
            except BaseException:
                await drop(sock, tracker)
                raise
            sock.close(linger=5000)
        finally:
            self._once.release()

    def _receiver(self, address: str) -> _Receiver:
        receiver = self._receivers.get(address)
        if receiver is not None:
            self._receivers.move_to_end(address)
            return receiver
        if len(self._receivers) >= self.max_receivers:
            idle = next((a for a, r in self._receivers.items() if r.users == 0), None)
            if idle is None:
                raise SglangError(503, f"{len(self._receivers)} receivers busy (--sglang-max-receivers); retry later")
            self._close(idle)
        receiver = self._receivers[address] = _Receiver()
        return receiver

    async def _push_cached(self, address: str, frames: list[Any]) -> None:
        """One message at a time per receiver, each until ZMQ has sent it: a message that cannot go is dropped with
        its socket (never left queued, reading a region its part no longer holds) and the next send opens another."""
        receiver = self._receiver(address)
        receiver.users += 1
        try:
            async with receiver.lock:
                if receiver.sock is None:
                    receiver.sock = self._socket(address)
                sock, tracker = receiver.sock, None
                try:
                    tracker = await asyncio.wait_for(
                        sock.send_multipart(frames, copy=False, track=True), self.timeout_s
                    )
                    await _sent(tracker, self.timeout_s)
                except BaseException:
                    receiver.sock = None
                    await drop(sock, tracker)
                    raise
        finally:
            receiver.users -= 1
            receiver.used = time.monotonic()

    def expire(self, now: float | None = None) -> int:
        """Close the cached sockets idle longer than `idle_s`; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [a for a, r in self._receivers.items() if r.users == 0 and now - r.used > self.idle_s]
        for address in stale:
            self._close(address)
        return len(stale)

    def _close(self, address: str) -> None:
        receiver = self._receivers.pop(address)
        if receiver.sock is not None:
            receiver.sock.close(linger=0)
            receiver.sock = None

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.IPV6, 1)  # a prefill's address may be IPv6 (and IPv4 still works)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(address)
        return sock

    def close(self) -> None:
        """Close every receiver socket and the ZMQ context, one-shot sockets still sending too (term() would wait for
        them for ever)."""
        for address in list(self._receivers):
            self._close(address)
        self._zmq.destroy(linger=0)
