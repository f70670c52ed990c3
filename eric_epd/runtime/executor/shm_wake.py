"""Wake-up channel of the shm broadcast: the writer pings a ZMQ PUB socket after each message, and a reader that has
been idle for a while blocks on those pings instead of polling shared memory (vLLM's SpinCondition idea)."""

from __future__ import annotations

import time
from contextlib import suppress
from pathlib import Path

import zmq

_CLOSE_LINGER_MS = 200  # the last ping (close) still leaves after the socket is closed
BUSY_BLOCK_S = 0.001
"""While busy, a reader blocks on pings this long at a time (ZMQ's poll counts whole milliseconds)."""


class WakeSender:
    """Writer side: one PUB socket; notify() never blocks (a ping nobody can take is dropped)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        self._sock.bind(address)

    def notify(self) -> None:
        """Ping the readers that a message is waiting (dropped when the socket cannot take it now)."""
        with suppress(zmq.Again):
            self._sock.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Close the PUB socket and remove its ipc file."""
        self._sock.close()
        if self.address.startswith("ipc://"):  # libzmq unlinks it too, but not on every version
            with suppress(FileNotFoundError):
                Path(self.address.removeprefix("ipc://")).unlink()


class WakeReceiver:
    """Reader side: for `busy_s` after the last message it took, the caller polls briefly and then blocks on the
    writer's pings a millisecond at a time; idle, it blocks in chunks of at most `block_s`. A lost ping costs one
    chunk, never a message."""

    def __init__(self, address: str, busy_s: float, block_s: float) -> None:
        self.busy_s, self.block_s = busy_s, block_s
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.CONFLATE, 1)  # pings that came while we were busy collapse into one
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(address)
        self._last = time.monotonic()

    def touched(self) -> None:
        """A message was taken: stay in the busy (polling) phase for another busy_s."""
        self._last = time.monotonic()

    def idle(self, now: float) -> bool:
        """Whether `busy_s` has passed since the last message was taken, so the reader should block on pings."""
        return now - self._last >= self.busy_s

    def block(self, max_s: float, busy: bool = False) -> None:
        """Sleep until a ping (maybe one left over: the caller checks again) or min(max_s, the chunk) passed; the
        chunk is BUSY_BLOCK_S while `busy` (the caller's abort checks stay frequent), else block_s."""
        chunk = BUSY_BLOCK_S if busy else self.block_s
        if self._sock.poll(max(0, int(min(max_s, chunk) * 1000))):
            with suppress(zmq.Again):
                self._sock.recv(zmq.NOBLOCK)

    def close(self) -> None:
        """Close the SUB socket."""
        self._sock.close()
