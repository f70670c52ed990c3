"""The units of work the engine and the executor share: an item and its opaque spec, a batch of them, what a batch
gives back or how it fails, and the workers that run it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import msgspec


class WorkItem(msgspec.Struct, array_like=True, frozen=True):
    """One item of work; its input travels as the matching extra frame.

    The router reserved `out_nbytes` at `out_offset` of its output pool; worker rank 0 writes the result there.
    """

    key: str
    """The workload's name for the item (unique among the items in flight)."""
    kind: str
    """Items of one kind batch together (the workload decides what a kind is)."""
    cost: int
    """What the batch cap counts, in the workload's own unit."""
    out_offset: int
    out_nbytes: int
    spec: msgspec.Raw
    """The workload's own description of the item (msgpack), opaque to the engine: see `pack_spec`."""
    input_dtype: str = "float32"
    """The dtype of its input frame (INPUT_DTYPES): "float32", or "uint8" for levels the workload's runner turns into
    its input on the device (a quarter of the bytes through the engine and the broadcast)."""


INPUT_DTYPES = {"float32": 4, "uint8": 1}
"""The dtypes an item's input may cross the processes in, and their sizes in bytes."""


SpecT = TypeVar("SpecT", bound=msgspec.Struct)


def pack_spec(spec: msgspec.Struct) -> msgspec.Raw:
    """A workload's item spec as the opaque field of a WorkItem."""
    return msgspec.Raw(msgspec.msgpack.encode(spec))


def unpack_spec(item: WorkItem, spec_type: type[SpecT]) -> SpecT | None:
    """The item's spec as the workload's type, or None when it is not one."""
    try:
        return msgspec.msgpack.decode(item.spec, type=spec_type)
    except msgspec.MsgspecError:
        return None


class ItemResult(msgspec.Struct, array_like=True, frozen=True):
    """One finished output, now in the pool at the item's reserved region."""

    key: str
    shape: tuple[int, ...]
    dtype: str


class WorkerInfo(msgspec.Struct, array_like=True, frozen=True):
    """One worker process: its pid, the CPUs it is pinned to and its torch threads (0 until it reported)."""

    pid: int
    cpus: list[int] = []
    threads: int = 0


@dataclass
class QueuedItem:
    """One item waiting to run, with its input (a view on the received frame)."""

    request_id: str
    index: int
    """Position of the item inside its request."""
    item: WorkItem
    input: memoryview


@dataclass
class Batch:
    """Items of a single kind that run in one forward."""

    batch_id: int
    kind: str
    entries: list[QueuedItem] = field(default_factory=list)

    @property
    def cost(self) -> int:
        """The batch's total cost, in the workload's unit (what the scheduler's cap counts)."""
        return sum(e.item.cost for e in self.entries)


class BatchFailedError(Exception):
    """The batch failed but the workers are fine (e.g. a shape the model rejects)."""


class WorkersDeadError(Exception):
    """A worker died or stopped answering: the engine can no longer run batches."""


@dataclass(frozen=True)
class BatchOutput:
    """One executed batch: a result per item, in batch order, and rank 0's timings."""

    items: list[ItemResult]
    compute_seconds: float = 0.0
    write_seconds: float = 0.0
