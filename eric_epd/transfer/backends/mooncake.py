"""Mooncake TransferEngine backend (P2P handshake, no metadata server): Eric registers its pool once, and
consumers pull entries into registered staging buffers over TCP or RDMA."""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from eric_epd.transfer.backends.base import TransferError
from eric_epd.wire.handles import EmbeddingHandle, MooncakeLocation

logger = logging.getLogger(__name__)

_NO_BATCH = (0, (1 << 64) - 1)  # what batch_transfer_async_read returns when it could not submit
_DONE, _FAILED, _ENGINE_TIMEOUT = 1, -1, -2  # transfer_check_status; 1 and -1 also free the batch
_SPIN_S, _MAX_POLL_S = 100e-6, 200e-6
_MAX_OPENED = 4096


def _listening_ports() -> set[tuple[str, int]]:
    """This process's listening TCP sockets (address, port)."""
    import psutil  # a vLLM dependency, imported only when Mooncake is used

    conns = psutil.Process().net_connections(kind="tcp")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def _warn_wide_listeners(before: set[tuple[str, int]], host: str) -> None:
    """Mooncake cannot bind one interface: say which of its ports listen on every interface, to be firewalled."""
    wide = sorted(port for ip, port in _listening_ports() - before if ip in ("0.0.0.0", "::"))
    if wide:
        logger.warning(
            "mooncake: ports %s listen on every interface, not only %s (Mooncake has no bind setting); anyone who "
            "reaches them can read and write this process's registered memory: firewall them to the private network",
            wide,
            host,
        )


def _new_engine(host: str, protocol: str, device: str) -> Any:
    """Mooncake logs through glog at INFO; MC_LOG_LEVEL=ERROR in the environment quiets it, but it is read only when
    mooncake.engine is first imported, which this module does lazily, at the first engine."""
    from mooncake.engine import TransferEngine  # optional dependency: imported only when the backend is used

    engine = TransferEngine()
    before = _listening_ports()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise TransferError(f"mooncake: initialize(host={host!r}, protocol={protocol!r}, device={device!r}) rc={rc}")
    _warn_wide_listeners(before, host)
    return engine


class MooncakeProducer:
    """Inside Eric: one engine that serves the registered pool; a handle names it by session id host:rpc_port, so
    `host` must be the address consumers reach (not 0.0.0.0). `device` filters RDMA NICs (e.g. "mlx5_0")."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        self.protocol = protocol
        self._engine: Any = _new_engine(host, protocol, device)
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._pool: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def register(self, base_addr: int, nbytes: int) -> None:
        """`ProducerBackend` hook: register the pool with the engine once (again with the same pool: nothing to do)."""
        with self._lock:
            if self._engine is None:
                raise RuntimeError("mooncake producer is closed")
            if self._pool is not None:
                if self._pool != (base_addr, nbytes):
                    raise RuntimeError(f"mooncake producer already serves pool {self._pool}")
                return
            rc = self._engine.register_memory(base_addr, nbytes)
            if rc != 0:
                raise TransferError(f"mooncake: register_memory({base_addr:#x}, {nbytes}) rc={rc}")
            self._pool = (base_addr, nbytes)

    def location(self, offset: int) -> MooncakeLocation:
        """`ProducerBackend` hook: the session id and address of pool `offset`, and the protocol it is served over."""
        if self._pool is None:
            raise RuntimeError("mooncake producer: register() the pool first")
        base, nbytes = self._pool
        if not 0 <= offset <= nbytes:
            raise ValueError(f"offset {offset} is outside the {nbytes}-byte pool")
        return MooncakeLocation(session_id=self.session_id, addr=base + offset, protocol=self.protocol)

    def metadata(self) -> bytes:
        """`ProducerBackend` hook: nothing (the P2P handshake needs no metadata up front)."""
        return b""

    def close(self) -> None:
        """Unregister the pool and stop the engine (its listeners close); idempotent."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is not None and self._pool is not None:
                engine.unregister_memory(self._pool[0])
            self._pool = None


class _Slot:
    """One registered staging buffer; `pending` is set while the engine may still write into it."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.addr: int = buf.ctypes.data
        self.pending: Future[int] | None = None


class MooncakeConsumer:
    """Pulls entries through registered staging buffers (`staging_bytes` in `chunk_bytes` slots; reads larger
    than a slot go chunk by chunk), then copies them into `dst`. Thread-safe: one engine, a slot per read.

    Every chunk must finish within `timeout_s` or read() raises TransferError; a transfer abandoned that way keeps
    its slot (never the caller's `dst`) until the engine gives up on it, so late bytes cannot land in caller memory.
    Submissions run on a helper thread because Mooncake opens an unknown session synchronously, under an
    engine-wide lock, and that handshake blocks ~60 s against a frozen peer; a first contact is preceded by a TCP
    connect to the session's port, so an unreachable host fails here instead of inside that lock.
    """

    name = "mooncake"

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        staging_bytes: int = 64 << 20,
        *,
        chunk_bytes: int = 8 << 20,
        timeout_s: float = 10.0,
    ) -> None:
        if staging_bytes <= 0 or chunk_bytes <= 0 or timeout_s <= 0:
            raise ValueError("staging_bytes, chunk_bytes and timeout_s must be positive")
        self.protocol = protocol
        self.timeout_s = timeout_s
        self._chunk = min(chunk_bytes, staging_bytes)
        self._nslots = max(1, staging_bytes // self._chunk)
        self._engine: Any = _new_engine(host, protocol, device)
        self._submitter = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mooncake-submit")
        self._cond = threading.Condition()
        self._free = [self._new_slot() for _ in range(self._nslots)]
        self._live = self._nslots  # slots not abandoned: free or in use
        self._zombies: list[_Slot] = []
        self._opened: set[str] = set()  # sessions the engine has opened (no probe needed)
        self._active = 0
        self._closed = False

    def usable(self, handle: EmbeddingHandle) -> bool:
        """Whether the handle has a Mooncake location served over this consumer's protocol."""
        return handle.mooncake is not None and handle.mooncake.protocol == self.protocol

    def why_unusable(self, handle: EmbeddingHandle) -> str | None:
        """Why this consumer cannot read the handle's Mooncake location (a protocol mismatch), or None."""
        if handle.mooncake is None or handle.mooncake.protocol == self.protocol:
            return None
        return (
            f"the producer serves Mooncake over {handle.mooncake.protocol}, this consumer's engine uses "
            f"{self.protocol} (set the consumer's Mooncake protocol to {handle.mooncake.protocol})"
        )

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        """`ConsumerBackend` hook: read the entry from the producer's session into `dst` through the staging slots."""
        loc = handle.mooncake
        if loc is None:
            raise TransferError(f"mooncake: handle {handle.hash} has no mooncake location")
        if not (isinstance(dst, np.ndarray) and dst.dtype == np.uint8 and dst.flags.c_contiguous):
            raise ValueError("dst must be a C-contiguous uint8 numpy array")
        if dst.nbytes != handle.nbytes or not dst.flags.writeable:
            raise ValueError(f"dst must be writeable and hold exactly {handle.nbytes} bytes (has {dst.nbytes})")
        session = loc.session_id
        if loc.protocol != self.protocol:
            raise TransferError(f"mooncake session {session}: producer speaks {loc.protocol!r}, we {self.protocol!r}")
        with self._cond:
            if self._closed:
                raise TransferError(f"mooncake session {session}: consumer is closed")
            self._active += 1
        try:
            if handle.nbytes and session not in self._opened:
                self._probe(session)
            self._read(session, loc.addr, dst.reshape(-1))
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def _read(self, session: str, addr: int, dst: np.ndarray) -> None:
        n = dst.nbytes
        if n == 0:
            return
        slot = self._acquire(session)
        try:
            for off in range(0, n, self._chunk):
                k = min(self._chunk, n - off)
                error = self._pull(session, slot, addr + off, k)
                if error is not None:
                    self._opened.discard(session)
                    raise TransferError(f"mooncake session {session}: read of {k} bytes at {addr + off:#x} {error}")
                dst[off : off + k] = slot.buf[:k]
        finally:
            self._release(slot)
        if len(self._opened) >= _MAX_OPENED:
            self._opened.clear()
        self._opened.add(session)

    def _probe(self, session: str) -> None:
        host, _, port = session.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s):
                pass
        except (OSError, ValueError) as e:
            raise TransferError(f"mooncake session {session} is unreachable: {e}") from e

    def _pull(self, session: str, slot: _Slot, remote: int, n: int) -> str | None:
        """Move n bytes at `remote` into `slot`; None when done, else why not. Leaves `slot.pending` set when the
        engine may still write into the slot."""
        deadline = time.monotonic() + self.timeout_s
        submit = self._submitter.submit(self._engine.batch_transfer_async_read, session, [slot.addr], [remote], [n])
        try:
            batch = submit.result(timeout=self.timeout_s)
        except FutureTimeout:
            if not submit.cancel():
                slot.pending = submit
            return f"was not accepted within {self.timeout_s:g} s (session handshake hangs: producer frozen?)"
        except Exception as e:
            return f"could not be submitted: {e!r}"
        if batch in _NO_BATCH:
            return "could not be submitted (session cannot be opened: producer gone?)"
        delay, spin_until = 10e-6, time.monotonic() + _SPIN_S  # spin briefly: small reads finish in ~50 us
        while True:
            status = self._engine.transfer_check_status(batch)
            if status == _DONE:
                return None
            if status == _FAILED:
                return "failed (producer gone, restarted, or address not registered)"
            now = time.monotonic()
            if status == _ENGINE_TIMEOUT or now >= deadline:
                slot.pending = submit
                return f"did not complete within {self.timeout_s:g} s (producer stalled or unreachable)"
            if now >= spin_until:
                time.sleep(delay)
                delay = min(2 * delay, _MAX_POLL_S)

    def _new_slot(self) -> _Slot:
        slot = _Slot(np.empty(self._chunk, dtype=np.uint8))
        rc = self._engine.register_memory(slot.addr, self._chunk)
        if rc != 0:
            raise TransferError(f"mooncake: register_memory of a {self._chunk}-byte staging buffer rc={rc}")
        return slot

    def _acquire(self, session: str) -> _Slot:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                self._reap()
                if self._free:
                    return self._free.pop()
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    raise TransferError(
                        f"mooncake session {session}: no staging buffer free within {self.timeout_s:g} s "
                        f"({len(self._zombies)} held by abandoned transfers)"
                    )
                self._cond.wait(min(remaining, 0.05) if self._zombies else remaining)

    def _release(self, slot: _Slot) -> None:
        with self._cond:
            if slot.pending is None:
                self._free.append(slot)
            else:
                self._zombies.append(slot)
                self._live -= 1
                logger.warning("mooncake: abandoned a transfer; %d staging buffer(s) held", len(self._zombies))
                if len(self._zombies) <= self._nslots and not self._closed:
                    try:  # replace it, so reads from healthy producers go on (bounded: twice staging_bytes)
                        self._free.append(self._new_slot())
                        self._live += 1
                    except TransferError as e:
                        logger.warning("%s", e)
            self._cond.notify()

    def _reap(self) -> None:
        """Caller holds the lock. Take back slots whose abandoned transfer the engine has finished or failed."""
        for slot in list(self._zombies):
            submit = slot.pending
            assert submit is not None
            if not submit.done():
                continue
            batch = None if submit.exception() else submit.result()
            if batch not in (None, *_NO_BATCH) and self._engine.transfer_check_status(batch) not in (_DONE, _FAILED):
                continue
            self._zombies.remove(slot)
            slot.pending = None
            if self._live < self._nslots:
                self._free.append(slot)
                self._live += 1
            else:
                self._engine.unregister_memory(slot.addr)

    def close(self) -> None:
        """Wait for reads in progress (each is bounded by timeout_s), then free the buffers and stop the engine.
        Idempotent. While an abandoned transfer is unresolved the engine and its buffers are kept (leaked)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            idle = self._cond.wait_for(lambda: self._active == 0, timeout=2 * self.timeout_s + 1)
            if idle:
                self._reap()
            self._submitter.shutdown(wait=False, cancel_futures=True)
            if not idle or self._zombies:
                logger.warning("mooncake: closing with transfers unresolved; keeping the engine and its buffers")
                return
            for slot in self._free:
                self._engine.unregister_memory(slot.addr)
            self._free.clear()
            self._engine = None
