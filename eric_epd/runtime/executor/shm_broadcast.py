"""Shared-memory ring buffer: one writer (the engine) broadcasts each batch to N reader processes (workers).
A message is a small msgspec header plus raw buffers (tensor payloads): copied once, never pickled. Readers poll
while messages flow and block on the writer's wake-up pings once idle (shm_wake)."""

from __future__ import annotations

import logging
import math
import os
import secrets
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from eric_epd.common.shm import Segment as _Shm
from eric_epd.common.shm import attach_untracked as _attach_untracked
from eric_epd.runtime.executor.shm_layout import (
    ALIGN,
    C_LEN,
    C_NAME_LEN,
    C_READ,
    C_SEQ,
    G_CLOSED,
    MAGIC,
    MAX_NAME,
    NAME_OFF,
    align,
    geometry,
    memory_fence,
)
from eric_epd.runtime.executor.shm_wake import WakeReceiver, WakeSender
from eric_epd.runtime.executor.tensor_views import as_bytes

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_ABORT_CHECK_S, _MIN_SLEEP_S, _MAX_SLEEP_S = 0.01, 2e-5, 5e-4  # should_abort() may be a syscall: rate-limit
_SPIN_S = 1e-4
"""A reader with wake-up pings sleeps-and-polls only this long (20, 40, 80 us); then it blocks on the pings, which
wake it as a message lands: polling on with sleeps of up to 0.5 ms cost a request 0.3 ms p50 of waiting for its
batch to start (one writer and one reader on one core, a message every 4 ms)."""
BROADCAST_PREFIX = "ebc_"
"""Every ring's segment name starts so (and its spills' names with the ring's): what a server's start sweeps."""
BUSY_S, IDLE_BLOCK_S = 1.0, 0.1  # readers poll for BUSY_S after a message, then block on pings IDLE_BLOCK_S at a time


class BroadcastAborted(RuntimeError):  # noqa: N818 (name fixed by the executor's API)
    """A wait was abandoned because should_abort() returned True (e.g. a peer process died)."""


class BroadcastClosed(BroadcastAborted):
    """The writer closed the queue and there is no further message for this reader."""


class BroadcastHandle(msgspec.Struct, frozen=True):
    """What a reader process needs to attach; msgspec-encodable (and picklable for spawn args)."""

    name: str
    n_readers: int
    n_slots: int
    slot_bytes: int
    wake: str = ""
    """ZMQ address of the writer's wake-up pings; empty: readers only ever poll."""


def _poll(
    ready: Callable[[], bool],
    timeout: float | None,
    should_abort: Callable[[], bool] | None,
    what: str,
    wake: WakeReceiver | None = None,
) -> None:
    """Wait until ready(), sleeping with exponential backoff (with `wake`: for _SPIN_S, then blocking on its pings);
    TimeoutError / BroadcastAborted otherwise."""
    next_abort_check, sleep = time.monotonic(), _MIN_SLEEP_S
    deadline = None if timeout is None else next_abort_check + timeout
    while not ready():
        now = time.monotonic()
        if should_abort is not None and now >= next_abort_check:
            if should_abort():
                raise BroadcastAborted(f"{what}: aborted by should_abort()")
            next_abort_check = now + _ABORT_CHECK_S
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"{what}: timed out after {timeout:.3f}s")
        if wake is not None and (sleep > _SPIN_S or wake.idle(now)):
            wake.block(math.inf if deadline is None else deadline - now, busy=not wake.idle(now))
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP_S)


class ShmBroadcast:
    """Ring of ``n_slots`` slots in one SharedMemory segment; one writer, ``n_readers`` readers.

    Layout (int64 little-endian words; control blocks 64-byte aligned, slot data page aligned)::

        0         global header (64 B): magic | n_readers | n_slots | slot_bytes | closed | pad
        64        control block of slot s, ctrl_stride = align64(128 + 8 * n_readers) B each:
                    +0    seq       0 = never written, else index + 1 of the message in the slot (writer)
                    +8    length    payload bytes, in the slot or in the spill segment            (writer)
                    +16   name_len  0 = payload inline, else length of the spill segment name      (writer)
                    +64   name      spill segment name, ascii, <= 64 B                             (writer)
                    +128  read[r]   seq of the message reader r last released from this slot (reader r)
        data_off  data of slot s, align4096(slot_bytes) B each; data_off = align4096(64 + n_slots*ctrl)

    Payload, in the slot or (if larger than slot_bytes) in a spill segment ``<name>_<index>``: count
    (= 1 + number of buffers) | len[0] (header) | len[1..] (buffers), then each part 64-byte aligned.

    Protocol: message i goes to slot ``i % n_slots``. The writer reuses a slot once every ``read[r]``
    equals its ``seq`` (all readers released the previous message), writes the payload, fences, stores
    ``seq = i + 1``. Reader r waits for exactly ``seq == i + 1``, fences, reads, fences, stores
    ``read[r] = i + 1``. Sequence numbers only grow: no reader takes an old message (or spill name) for
    a new one, and every reader sees every message.

    The writer owns and unlinks spill segments, once all readers released the message (checked on every
    enqueue, at the latest when the slot is reused) and at unlink()/close(); readers map them untracked
    and unmap at release(). At most n_slots exist; if the writer dies its resource_tracker unlinks all."""

    def __init__(self, shm: SharedMemory, handle: BroadcastHandle) -> None:
        self._shm, self._handle = shm, handle
        self.name, self.n_readers = handle.name, handle.n_readers
        self.n_slots, self.slot_bytes = handle.n_slots, handle.slot_bytes
        ctrl, self._data_off, self._slot_stride, _ = geometry(self.n_readers, self.n_slots, self.slot_bytes)
        self._glob = np.ndarray((8,), np.int64, buffer=shm.buf)
        self._ctrl = np.ndarray((self.n_slots, ctrl // 8), np.int64, buffer=shm.buf, offset=64)
        self._closed = False

    @staticmethod
    def create(
        n_readers: int,
        n_slots: int = 4,
        slot_bytes: int = 32 << 20,
        *,
        name: str | None = None,
        wake: str | None = None,
    ) -> ShmBroadcastWriter:
        """Create the segment (engine process). The creator owns it: close() unlinks it. ``wake``: where to bind
        the wake-up pings (default ``ipc://<tmp>/<name>.wake``; "" for none: readers then always poll)."""
        name = name or f"{BROADCAST_PREFIX}{os.getpid():x}_{secrets.token_hex(4)}"
        if n_readers < 1 or n_slots < 1 or slot_bytes < ALIGN or len(name) > MAX_NAME:
            raise ValueError(f"bad {n_readers=} {n_slots=} {slot_bytes=} or {name=} (max {MAX_NAME} chars)")
        wake = f"ipc://{tempfile.gettempdir()}/{name}.wake" if wake is None else wake
        shm = _Shm(name=name, create=True, size=geometry(n_readers, n_slots, slot_bytes)[3])
        try:
            writer = ShmBroadcastWriter(shm, BroadcastHandle(shm.name, n_readers, n_slots, slot_bytes, wake))
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        writer._glob[:5] = (MAGIC, n_readers, n_slots, slot_bytes, 0)
        logger.debug("broadcast %s: %d readers, %d slots of %d B", shm.name, n_readers, n_slots, slot_bytes)
        return writer

    @staticmethod
    def attach(
        handle: BroadcastHandle, reader_rank: int, *, busy_s: float = BUSY_S, block_s: float = IDLE_BLOCK_S
    ) -> ShmBroadcastReader:
        """Map an existing broadcast as reader ``reader_rank`` (0..n_readers-1), e.g. in a worker. Waits poll
        for ``busy_s`` after each message, then block on the writer's pings (``block_s`` at a time)."""
        if not 0 <= reader_rank < handle.n_readers:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.n_readers})")
        shm = _attach_untracked(handle.name)
        wake = WakeReceiver(handle.wake, busy_s, block_s) if handle.wake else None
        reader = ShmBroadcastReader(shm, handle, reader_rank, wake)
        found = tuple(int(x) for x in reader._glob[:4])
        if found != (MAGIC, handle.n_readers, handle.n_slots, handle.slot_bytes):
            reader.close()
            raise ValueError(f"segment {handle.name} does not match {handle}: header {found}")
        return reader

    def handle(self) -> BroadcastHandle:
        """What a reader needs to attach: segment name, reader count, slots, slot size and wake address."""
        return self._handle

    def _slot_view(self, slot: int, nbytes: int) -> memoryview:
        start = self._data_off + slot * self._slot_stride
        return self._shm.buf[start : start + nbytes]

    def _unmap(self) -> None:
        self._glob = self._ctrl = np.zeros((0, 0), np.int64)  # drop our own exports of the mapping first
        self._shm.close()  # stays mapped while a caller's tensor still uses it (see _Shm)


class ShmBroadcastWriter(ShmBroadcast):
    """The single writer (not thread-safe). Made by ShmBroadcast.create()."""

    def __init__(self, shm: SharedMemory, handle: BroadcastHandle) -> None:
        super().__init__(shm, handle)
        self._seq, self._slot_seq = 0, [0] * self.n_slots  # next message index; seq we last stored per slot
        self._spills: dict[int, SharedMemory] = {}
        self._unlinked = False
        self.n_spilled = 0  # messages that did not fit a slot and used a spill segment
        self._wake = WakeSender(handle.wake) if handle.wake else None

    def _slot_free(self, slot: int) -> bool:
        return bool((self._ctrl[slot, C_READ : C_READ + self.n_readers] == self._slot_seq[slot]).all())

    def _drop_spill(self, slot: int) -> None:
        if (spill := self._spills.pop(slot, None)) is not None:
            spill.close()
            with suppress(FileNotFoundError):
                spill.unlink()

    def enqueue(
        self,
        header: bytes | bytearray | memoryview,
        buffers: Sequence[memoryview | bytes | bytearray | np.ndarray | torch.Tensor] = (),
        *,
        timeout: float | None = None,
        should_abort: Callable[[], bool] | None = None,
    ) -> None:
        """Publish one message to all readers, first waiting (up to ``timeout`` s) for its slot to free up.

        TimeoutError, or BroadcastAborted once ``should_abort()`` (polled every ~10 ms, e.g. ``lambda: not
        all(p.is_alive() for p in workers)``) is True: then nothing was published and a retry is fine."""
        if self._closed:
            raise BroadcastClosed(f"broadcast {self.name}: enqueue after close()")
        parts = [as_bytes(header), *(as_bytes(b) for b in buffers)]
        lens = [p.nbytes for p in parts]
        offsets, total = [], align(8 * (1 + len(parts)))
        for n in lens:
            offsets.append(total)
            total = align(total + n)
        seq, slot = self._seq, self._seq % self.n_slots
        for s in [s for s in self._spills if self._slot_free(s)]:  # unlink released spills early
            self._drop_spill(s)
        _poll(lambda: self._slot_free(slot), timeout, should_abort, f"broadcast {self.name} enqueue #{seq}")
        memory_fence()  # saw all read[r] stores before we overwrite the slot
        self._drop_spill(slot)
        if total <= self.slot_bytes:
            name, dst = b"", self._slot_view(slot, total)
        else:
            spill = self._spills[slot] = _Shm(name=f"{self.name}_{seq}", create=True, size=total)
            self.n_spilled += 1
            name, dst = spill.name.encode(), spill.buf[:total]
        with dst:
            struct.pack_into(f"<{1 + len(lens)}Q", dst, 0, len(parts), *lens)
            for o, n, p in zip(offsets, lens, parts, strict=True):
                dst[o : o + n] = p
        self._ctrl[slot, C_LEN], self._ctrl[slot, C_NAME_LEN] = total, len(name)
        if name:
            self._ctrl.view(np.uint8)[slot, NAME_OFF : NAME_OFF + len(name)] = np.frombuffer(name, np.uint8)
        memory_fence()  # payload, length and name are visible before seq publishes them
        self._ctrl[slot, C_SEQ] = self._slot_seq[slot] = seq + 1
        self._seq += 1
        if self._wake is not None:
            self._wake.notify()

    def unlink(self) -> None:
        """Remove the names of the segment and of outstanding spills (mappings stay valid). Idempotent."""
        for slot in list(self._spills):
            self._drop_spill(slot)
        if not self._unlinked:
            self._unlinked = True
            with suppress(FileNotFoundError):
                self._shm.unlink()

    def close(self) -> None:
        """Mark closed (blocked readers get BroadcastClosed), unlink everything and unmap. Idempotent."""
        if self._closed:
            return
        self._closed = True
        memory_fence()  # all published messages precede the closed flag
        self._glob[G_CLOSED] = 1
        if self._wake is not None:
            self._wake.notify()  # idle readers see the closed flag now
            self._wake.close()
        self.unlink()
        self._unmap()


class ShmBroadcastReader(ShmBroadcast):
    """One reader rank (one process, not thread-safe). Made by ShmBroadcast.attach()."""

    def __init__(
        self, shm: SharedMemory, handle: BroadcastHandle, reader_rank: int, wake: WakeReceiver | None = None
    ) -> None:
        super().__init__(shm, handle)
        self._wake = wake
        self.reader_rank, self._seq = reader_rank, 0  # _seq: index of the next message to read
        self._pending: tuple[int, SharedMemory | None, list[memoryview]] | None = None  # slot, spill, views

    def _ready(self, slot: int, want: int) -> bool:
        if int(self._ctrl[slot, C_SEQ]) == want:
            return True
        if int(self._glob[G_CLOSED]):
            memory_fence()  # the last seq store precedes the closed flag: look once more
            if int(self._ctrl[slot, C_SEQ]) == want:
                return True
            raise BroadcastClosed(f"broadcast {self.name}: writer closed")
        return False

    def dequeue(
        self, timeout: float | None = None, should_abort: Callable[[], bool] | None = None
    ) -> tuple[bytes, list[memoryview]]:
        """Next message: (header copy, read-only zero-copy views), or TimeoutError / BroadcastAborted /
        BroadcastClosed. The views stay mapped while referenced, but their data is valid until release()."""
        if self._closed:
            raise BroadcastClosed(f"broadcast {self.name}: dequeue after close()")
        if self._pending is not None:
            raise RuntimeError("release() the previous message before dequeue()")
        slot, want = self._seq % self.n_slots, self._seq + 1
        _poll(
            lambda: self._ready(slot, want),
            timeout,
            should_abort,
            f"broadcast {self.name} reader {self.reader_rank} dequeue #{self._seq}",
            self._wake,
        )
        if self._wake is not None:
            self._wake.touched()
        memory_fence()  # seq was seen before any payload load
        total, name_len = int(self._ctrl[slot, C_LEN]), int(self._ctrl[slot, C_NAME_LEN])
        spill = None
        if name_len:
            name = bytes(self._ctrl.view(np.uint8)[slot, NAME_OFF : NAME_OFF + name_len]).decode()
            try:
                spill = _attach_untracked(name)
            except FileNotFoundError as e:  # only once the writer unlinked everything
                raise BroadcastClosed(f"broadcast {self.name}: spill segment {name} is gone") from e
            base = spill.buf[:total]
        else:
            base = self._slot_view(slot, total)
        with base:
            (count,) = struct.unpack_from("<Q", base, 0)
            views, off = [], align(8 * (1 + count))
            for n in struct.unpack_from(f"<{count}Q", base, 8):
                views.append(base[off : off + n].toreadonly())
                off = align(off + n)
        header = bytes(views.pop(0))
        self._pending = (slot, spill, views)
        return header, views

    def release(self) -> None:
        """Hand the current message's slot back to the writer. No-op if nothing is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        slot, spill, _ = pending  # views are not released: a tensor over one must keep the mapping alive
        memory_fence()  # all payload loads are done before the writer may reuse the slot
        self._ctrl[slot, C_READ + self.reader_rank] = self._seq + 1
        self._seq += 1
        if spill is not None:
            spill.close()  # unmapped now, or when the last tensor over it dies (see _Shm)

    @contextmanager
    def receive(
        self, timeout: float | None = None, should_abort: Callable[[], bool] | None = None
    ) -> Iterator[tuple[bytes, list[memoryview]]]:
        """``with reader.receive(1.0) as (header, views): ...``: dequeue(), release() on exit."""
        header, views = self.dequeue(timeout, should_abort)
        try:
            yield header, views
        finally:
            self.release()

    def dequeue_copy(
        self, timeout: float | None = None, should_abort: Callable[[], bool] | None = None
    ) -> tuple[bytes, list[bytearray]]:
        """dequeue(), private writable copies of the buffers, release()."""
        with self.receive(timeout, should_abort) as (header, views):
            return header, [bytearray(v) for v in views]

    def close(self) -> None:
        """Release a pending message and unmap; never unlinks (the writer owns the names). Idempotent."""
        if not self._closed:
            self.release()
            self._closed = True
            if self._wake is not None:
                self._wake.close()
            self._unmap()
