"""Landing of Eric embeddings straight into each vLLM worker's device memory: the scheduler orders every rank to
read an item into its landing area and copy it out in the model's dtype (local ZMQ IPC sockets, typed messages), and
waits until all ranks have it; a rank whose read or copy fails fails the item before any request is scheduled."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq

from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.wire.handles import EmbeddingHandle

logger = logging.getLogger(__name__)

POLL_MS = 100
"""How often the receiving threads look at their stop flag."""


class LandingTimeoutError(TransferError):
    """Some rank did not report on its landing in time: it may still write into that range."""


class LandOrder(msgspec.Struct, frozen=True, tag=True):
    """Scheduler -> every rank: read `handle` into your landing area at `offset`, then copy it out (`take`)."""

    order: int
    offset: int
    handle: EmbeddingHandle
    only: str = ""
    """Read over this transport alone ("store": the global cache); empty: the best one that works."""


class Release(msgspec.Struct, frozen=True, tag=True):
    """Scheduler -> every rank: the range at `offset` is free again; drop the copy landed there."""

    offset: int


class LandNotice(msgspec.Struct, frozen=True):
    """Rank -> scheduler: order `order` ended; `error` is empty when the bytes are in place."""

    order: int
    rank: int
    backend: str = ""
    error: str = ""


MAX_IPC_PATH = 107
"""The longest path of a Unix-domain socket (sun_path holds 108 bytes with its terminating zero)."""


@dataclass(frozen=True)
class LandingAddress:
    """Where one engine's landing sockets live: one per vLLM instance and data-parallel index, on this host only, in
    a directory only this user may enter (`private_dir`: nobody else binds the names first or sends orders)."""

    instance: str
    dp_index: int = 0

    def _path(self, what: str) -> str:
        path = os.path.join(private_dir(), f"{self.instance}-{self.dp_index}-{what}.ipc")
        if len(path.encode()) > MAX_IPC_PATH:
            raise RuntimeError(f"landing socket path {path!r} is over {MAX_IPC_PATH} bytes: set a shorter TMPDIR")
        return path

    def orders(self, rank: int) -> str:
        """The ipc address where the worker of TP `rank` takes its landing orders."""
        return f"ipc://{self._path(f'orders{rank}')}"

    def notices(self) -> str:
        """The ipc address where the scheduler takes the ranks' landing notices."""
        return f"ipc://{self._path('notices')}"


def private_dir() -> str:
    """The temporary directory's `eric-land-<uid>`, made 0700 if missing; RuntimeError if another user owns it or
    others may enter it (a socket there would take orders from them)."""
    path = os.path.join(tempfile.gettempdir(), f"eric-land-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{path} must be a directory of this user's that no one else may enter (mode 0700)")
    return path


def _unlink(endpoint: str) -> None:
    try:
        os.unlink(endpoint.removeprefix("ipc://"))
    except FileNotFoundError:
        pass


def _serve(sock: zmq.Socket, kind: Any, handle: Callable[[Any], object], stop: threading.Event) -> None:
    """Receive typed messages on `sock` until `stop`, then close it (the socket belongs to this thread)."""
    decoder = msgspec.msgpack.Decoder(kind)
    while not stop.is_set():
        if not sock.poll(POLL_MS):
            continue
        try:
            message = decoder.decode(sock.recv())
        except msgspec.DecodeError as e:
            logger.error("bad %s message: %s", kind, e)
            continue
        handle(message)
    sock.close(linger=0)


class _Wait:
    def __init__(self, ranks: int) -> None:
        self.left = ranks
        self.errors: list[str] = []
        self.backends: dict[int, str] = {}  # rank -> the transport it read over
        self.done = threading.Event()
        self.settled: Callable[[], None] | None = None
        """Set once the order timed out: called when its last rank finally answers (it writes there no more)."""


def _landed_over(backends: dict[int, str]) -> str:
    """The transport a landing counts as: "store" (content-addressed, no ack needed) only if every rank read the
    store; else rank 0's, or the first other one's when rank 0 read the store."""
    first = backends.get(0, "")
    if first != "store":
        return first
    return next((b for _, b in sorted(backends.items()) if b != "store"), first)


class LandingChannel:
    """Scheduler side (EngineCore process). Thread-safe: `land` may run in many threads at once."""

    def __init__(self, address: LandingAddress, ranks: int) -> None:
        self._ranks = ranks
        self._ctx = zmq.Context()
        self._notices_at = address.notices()
        self._notices = self._ctx.socket(zmq.PULL)
        self._notices.bind(self._notices_at)
        self._orders = []
        for rank in range(ranks):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address.orders(rank))
            self._orders.append(sock)
        self._send = threading.Lock()
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="eric-land-notices", daemon=True)
        self._thread.start()

    def land(
        self,
        offset: int,
        handle: EmbeddingHandle,
        timeout_s: float,
        only: str = "",
        settled: Callable[[], None] | None = None,
    ) -> str:
        """Every rank reads the item into its landing area at `offset`; returns the transport rank 0 used, or one that
        is not the global store if any rank read the producer (those bytes need the ack to stand). Raises
        TransferError if a rank failed, LandingTimeoutError if one did not answer in time: a late rank may still
        write there, and `settled` is called (from the receiving thread) once every rank has answered."""
        with self._lock:
            order = next(self._ids)
            wait = self._waits[order] = _Wait(self._ranks)
        payload = msgspec.msgpack.encode(LandOrder(order, offset, handle, only))
        try:
            with self._send:
                for sock in self._orders:
                    sock.send(payload)
            wait.done.wait(timeout_s)
        except zmq.ZMQError as e:
            with self._lock:
                self._waits.pop(order, None)
            raise TransferError(f"landing of {handle.hash[:16]} on the workers failed: {e}") from e
        with self._lock:
            if wait.left > 0:  # stays registered: its last answer calls `settled`
                wait.settled = settled or (lambda: None)
                raise LandingTimeoutError(
                    f"landing of {handle.hash[:16]}: {wait.left} of {self._ranks} ranks did "
                    f"not answer within {timeout_s:g} s"
                )
            self._waits.pop(order, None)
        if wait.errors:
            raise TransferError("; ".join(wait.errors))
        return _landed_over(wait.backends)

    def _receive(self) -> None:
        _serve(self._notices, LandNotice, self._noted, self._stop)

    def _noted(self, notice: LandNotice) -> None:
        with self._lock:
            wait = self._waits.get(notice.order)
            if wait is None:
                return
            wait.left -= 1
            if notice.error:
                wait.errors.append(f"rank {notice.rank}: {notice.error}")
            wait.backends[notice.rank] = notice.backend
            settled = wait.settled if wait.left <= 0 else None
            if settled is not None:
                del self._waits[notice.order]
            elif wait.left <= 0:
                wait.done.set()
        if settled is not None:  # a timed-out order's last rank: its range may be reused now
            try:
                settled()
            except Exception:
                logger.exception("settling a late landing failed")

    def release(self, offset: int) -> None:
        """Every rank drops its copy of the item at `offset` (the range is free again). Never blocks: a rank that
        misses it only keeps a stale copy until that range is landed into again."""
        payload = msgspec.msgpack.encode(Release(offset))
        with self._send:
            for sock in self._orders:
                try:
                    sock.send(payload, zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    logger.warning("cannot tell a rank to drop its copy at %d: %s", offset, e)

    def close(self) -> None:
        """Stop the notice thread, close the order sockets and remove the notices' ipc file."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._send:
            for sock in self._orders:
                sock.close(linger=0)
        self._ctx.term()
        _unlink(self._notices_at)


class LandingArea:
    """Worker side: this rank's landing area (device memory), filled by background reads the scheduler orders.
    NIXL registers it once and READs into it directly; shm copies from Eric's pool straight to the device; the
    other transports go through a host buffer. Each landed item is then copied out (in `out_dtype`; None: its wire
    dtype) and kept until the scheduler releases its range: a step only takes the copy, it never allocates."""

    def __init__(
        self,
        address: LandingAddress,
        rank: int,
        nbytes: int,
        device: torch.device,
        fetcher: EmbeddingFetcher,
        threads: int,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        self.rank = rank
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._out_dtype = out_dtype
        self._copies: dict[int, tuple[str, torch.Tensor]] = {}  # offset -> (hash, its copy in the model's dtype)
        self._copies_lock = threading.Lock()
        self._fetcher = fetcher
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        fetcher.register_destination(self.buffer)
        self._ctx = zmq.Context()
        self._orders_at = address.orders(rank)
        self._orders = self._ctx.socket(zmq.PULL)
        self._orders.bind(self._orders_at)
        self._notices = self._ctx.socket(zmq.PUSH)
        self._notices.setsockopt(zmq.LINGER, 0)
        self._notices.connect(address.notices())
        self._send = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eric-land")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="eric-land-orders", daemon=True)
        self._thread.start()

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: str, out_dtype: torch.dtype | None) -> torch.Tensor:
        """A new tensor (`out_dtype`, else the wire dtype; this rank's device) holding the landed rows."""
        wire = getattr(torch, dtype)
        n = wire.itemsize
        for d in shape:
            n *= d
        if offset < 0 or offset + n > self.buffer.numel():
            raise ValueError(f"landed range [{offset}, {offset + n}) is outside the landing area")
        return self.buffer[offset : offset + n].view(wire).view(shape).to(out_dtype or wire, copy=True)

    def take(self, offset: int, key: str) -> torch.Tensor | None:
        """The copy of item `key` landed at `offset` (the same tensor each time, until its range is released)."""
        with self._copies_lock:
            copy = self._copies.get(offset)
        return copy[1] if copy is not None and copy[0] == key else None

    def copies(self) -> int:
        """Copies held (landed and not yet released)."""
        with self._copies_lock:
            return len(self._copies)

    def _receive(self) -> None:
        _serve(self._orders, LandOrder | Release, self._ordered, self._stop)

    def _ordered(self, message: LandOrder | Release) -> None:
        if isinstance(message, Release):
            with self._copies_lock:
                self._copies.pop(message.offset, None)
        else:
            self._pool.submit(self._land, message)

    def _land(self, order: LandOrder) -> None:
        h = order.handle
        backend, error = "", ""
        try:
            if order.offset < 0 or order.offset + h.nbytes > self.buffer.numel():
                raise ValueError(f"range [{order.offset}, {order.offset + h.nbytes}) is outside the landing area")
            with self._copies_lock:
                self._copies.pop(order.offset, None)
            dst = self.buffer[order.offset : order.offset + h.nbytes]
            if self._stream is None:
                backend = self._fetcher.read_into(h, dst, order.only)
                copy = self.tensor(order.offset, tuple(h.shape), h.dtype, self._out_dtype)
            else:  # device copies on a stream of our own, finished before the scheduler hears of them
                with torch.cuda.stream(self._stream):
                    backend = self._fetcher.read_into(h, dst, order.only)
                    copy = self.tensor(order.offset, tuple(h.shape), h.dtype, self._out_dtype)
                self._stream.synchronize()
            with self._copies_lock:
                self._copies[order.offset] = (h.hash, copy)
        except (TransferError, ValueError) as e:
            error = str(e)
        except Exception as e:  # the scheduler must always hear back, or the request would wait to its timeout
            logger.exception("landing of %s failed", h.hash[:16])
            error = f"{type(e).__name__}: {e}"
        if error:
            logger.error("rank %d: cannot land embedding %s from %s: %s", self.rank, h.hash[:16], h.producer, error)
        payload = msgspec.msgpack.encode(LandNotice(order.order, self.rank, backend, error))
        with self._send:
            self._notices.send(payload)

    def take_unusable(self) -> int:
        """Handles whose offered transport this rank skipped since the last call."""
        return self._fetcher.take_unusable()

    def close(self) -> None:
        """Stop the order thread and the landing pool, drop the copies, close the sockets and the fetcher."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._copies_lock:
            self._copies.clear()
        with self._send:
            self._notices.close(linger=0)
        self._ctx.term()
        _unlink(self._orders_at)
        self._fetcher.close()
