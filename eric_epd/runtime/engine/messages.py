"""Messages between the router (EngineClient) and the Engine process, over ZMQ ipc.

Wire format: frame 0 is a one-byte opcode, frame 1 the msgspec-msgpack header, frames 2.. each item's raw input
(whatever the workload feeds its model) towards the engine, one frame per item in header order. Outputs do not come
back this way: workers write them into the router's shared-memory pool. No pickle.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from eric_epd.runtime.work import ItemResult, WorkerInfo, WorkItem

UNAVAILABLE = "engine unavailable"
"""How every 503 from a dead engine or its workers begins."""


class Op(bytes, enum.Enum):
    """The one-byte opcode in frame 0 of every message between the router and the engine."""

    SUBMIT = b"E"
    RESULT = b"R"
    STATUS_REQUEST = b"S"
    STATUS = b"s"
    SHUTDOWN = b"X"
    ABORT = b"A"


class WorkRequestMsg(msgspec.Struct, array_like=True, frozen=True):
    """A request's items for the engine; each item's input travels as one extra frame, in item order."""

    request_id: str
    items: list[WorkItem]


class BatchStat(msgspec.Struct, array_like=True, frozen=True):
    """What one executed batch held and how long it took, for metrics."""

    kinds: tuple[str, ...]
    num_items: int
    cost: int
    seconds: float
    """The engine's whole wait for the batch: broadcast, forward, pool write, every rank's answer."""
    compute_seconds: float = 0.0
    """Rank 0's forward (output on the host)."""
    write_seconds: float = 0.0
    """Rank 0's copy of the output into the pool."""


class WorkResultMsg(msgspec.Struct, array_like=True, frozen=True):
    """The end of one request: all its items, or an error that names the cause. An aborted request (status 499)
    lists the items that were finished anyway; the others were never written."""

    request_id: str
    items: list[ItemResult] = []
    error: str | None = None
    status: int = 200
    batches: list[BatchStat] = []
    queue_seconds: float = 0.0
    """The request's time in the engine outside its own batches (waiting in the queue for them to start)."""


class EngineStatusMsg(msgspec.Struct, array_like=True, frozen=True):
    """The engine's health, queue depth, worker processes and the batches it finished since its last status."""

    healthy: bool
    reason: str
    queued_items: int
    running_items: int
    workers: list[WorkerInfo]
    batches: list[BatchStat] = []


class AbortRequestMsg(msgspec.Struct, array_like=True, frozen=True):
    """Drop a request's still-queued items: those at `items` (indices in the request), or all when None.

    Items already encoded stay encoded. The engine still answers the request exactly once, when none of it is
    queued or running: with its finished items and, if any item was dropped, an error (status 499). Only then may
    the router free the request's pool space. Unknown or finished request ids are ignored.
    """

    request_id: str
    items: list[int] | None = None


class ShutdownMsg(msgspec.Struct, array_like=True, frozen=True):
    """Ask the engine process to stop (and with it its workers); `reason` is logged."""

    reason: str = ""


_DECODERS = {
    Op.SUBMIT: msgspec.msgpack.Decoder(WorkRequestMsg),
    Op.RESULT: msgspec.msgpack.Decoder(WorkResultMsg),
    Op.STATUS: msgspec.msgpack.Decoder(EngineStatusMsg),
    Op.SHUTDOWN: msgspec.msgpack.Decoder(ShutdownMsg),
    Op.ABORT: msgspec.msgpack.Decoder(AbortRequestMsg),
}
_ENCODER = msgspec.msgpack.Encoder()

Message = WorkRequestMsg | WorkResultMsg | EngineStatusMsg | ShutdownMsg | AbortRequestMsg | None


def encode_frames(op: Op, msg: msgspec.Struct | None, buffers: Sequence[object] = ()) -> list[object]:
    """Frames for one message: opcode, header, then raw buffers (sent zero-copy by pyzmq)."""
    header = _ENCODER.encode(msg) if msg is not None else b""
    return [op.value, header, *buffers]


def _view(frame: object) -> memoryview:
    """A zero-copy view of a zmq.Frame (or any bytes-like object)."""
    buffer = getattr(frame, "buffer", None)
    return buffer if buffer is not None else memoryview(frame)  # type: ignore[arg-type]


def decode_frames(frames: Sequence[object]) -> tuple[Op, Message, list[memoryview]]:
    """Parse frames from encode_frames; unknown opcodes raise ValueError."""
    if len(frames) < 2:
        raise ValueError(f"malformed message: {len(frames)} frames")
    op = Op(bytes(_view(frames[0])))
    decoder = _DECODERS.get(op)
    msg = decoder.decode(_view(frames[1])) if decoder is not None else None
    return op, msg, [_view(f) for f in frames[2:]]
