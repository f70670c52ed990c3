"""Messages between the Engine (ModelExecutor) and its workers.

Engine -> workers: `ExecuteBatchMsg` header plus one input buffer per item (its WorkItem.input_dtype), broadcast
through shared memory.
Workers -> engine: `WorkerReadyMsg` once, then one `WorkerResultMsg` per batch per rank over ZMQ. Rank 0 writes each
item's output into the router's pool (shared memory) before it answers. msgspec only, no pickle.
"""

from __future__ import annotations

import msgspec

from eric_epd.runtime.work import WorkItem


class ExecuteBatchMsg(msgspec.Struct, array_like=True, frozen=True, tag="exec"):
    """Run one batch: every rank gets the items and their inputs through the shm broadcast."""

    batch_id: int
    kind: str
    items: list[WorkItem]
    """Each item's out_offset/out_nbytes say where rank 0 writes its output in the pool."""
    warmup: bool = False
    """The start-up batch: run on every rank, nothing written to the pool."""


class StopWorkerMsg(msgspec.Struct, array_like=True, frozen=True, tag="stop"):
    """Tell every worker to exit (broadcast like a batch); `reason` says why."""

    reason: str = ""


class WorkerReadyMsg(msgspec.Struct, array_like=True, frozen=True, tag="ready"):
    """A worker's answer at start: its rank and pid, and the error that kept it from loading, if any."""

    rank: int
    pid: int
    error: str | None = None
    cpus: list[int] = []
    """The CPUs this rank runs on, and its torch intra-op threads."""
    threads: int = 0


class WorkerResultMsg(msgspec.Struct, array_like=True, frozen=True, tag="result"):
    """One rank's answer to a batch: its output shapes and timings, or the error it failed with."""

    batch_id: int
    rank: int
    error: str | None = None
    shapes: list[tuple[int, ...]] = []
    """Each item's output shape, in batch order (rank 0)."""
    dtype: str = ""
    compute_seconds: float = 0.0
    """The forward's time on this rank (until the output is on the host)."""
    write_seconds: float = 0.0
    """Rank 0's copy of the output into the pool (0 on other ranks)."""


ToWorker = ExecuteBatchMsg | StopWorkerMsg
FromWorker = WorkerReadyMsg | WorkerResultMsg

to_worker_encoder = msgspec.msgpack.Encoder()
from_worker_encoder = msgspec.msgpack.Encoder()


def to_worker_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of the engine's messages to a worker (batches and stop)."""
    return msgspec.msgpack.Decoder(ToWorker)


def from_worker_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of a worker's messages to the engine (ready and results)."""
    return msgspec.msgpack.Decoder(FromWorker)
