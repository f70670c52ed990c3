"""Engine step logic, free of sockets: admits requests, finishes one batch per step (with the next one already
handed to the workers when `in_flight` is 2), completes whole requests."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from eric_epd.runtime.config import BatchLimits
from eric_epd.runtime.engine.messages import (
    UNAVAILABLE,
    AbortRequestMsg,
    BatchStat,
    EngineStatusMsg,
    WorkRequestMsg,
    WorkResultMsg,
)
from eric_epd.runtime.engine.scheduler import Scheduler
from eric_epd.runtime.work import (
    INPUT_DTYPES,
    Batch,
    BatchFailedError,
    BatchOutput,
    ItemResult,
    QueuedItem,
    WorkerInfo,
    WorkersDeadError,
    WorkItem,
)

logger = logging.getLogger(__name__)

ABORTED_STATUS = 499  # nginx's "client closed request": the router's client went away


class ItemValidator(Protocol):
    """Checks one item and its input size: why the engine must refuse it, or None (the workload's `validate`)."""

    def __call__(self, item: WorkItem, input_nbytes: int) -> str | None:
        """Why the engine must refuse the item (400), or None."""


class Executor(Protocol):
    """Runs the engine's batches on the workers: submit, collect in order, and report on the worker processes."""

    def submit(self, batch: Batch) -> None:
        """Hand a batch to the workers; WorkersDeadError when they are gone."""

    def collect(self, batch: Batch) -> BatchOutput:
        """The output of the oldest submitted batch; BatchFailedError or WorkersDeadError."""

    def workers(self) -> list[WorkerInfo]:
        """Each rank's worker process, with its CPUs and torch threads."""

    def check_workers(self) -> str | None:
        """Why the workers can no longer run batches, or None."""


Outgoing = tuple[WorkResultMsg, list[memoryview]]


@dataclass
class _RequestState:
    num_items: int
    arrived: float = field(default_factory=time.perf_counter)
    results: dict[int, ItemResult] = field(default_factory=dict)
    batches: list[BatchStat] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)
    """Items aborted while still queued: never run, never written."""
    failed: set[int] = field(default_factory=set)
    """Items of a batch that failed: that batch has ended, nothing writes them any more."""
    error: tuple[int, str] | None = None
    """(status, reason) of the request's first failed batch: its answer, once no batch of it is still running."""

    @property
    def open_items(self) -> int:
        """Items neither finished, failed nor dropped (queued, or in a batch the workers still run or write)."""
        return self.num_items - len(self.results) - len(self.dropped) - len(self.failed)


class Engine:
    """Drive with add_request() and step(); both return the messages to send back to the router."""

    def __init__(self, limits: BatchLimits, executor: Executor, validate: ItemValidator) -> None:
        self._executor = executor
        self._validate_item = validate
        self._scheduler = Scheduler(limits)
        self._requests: dict[str, _RequestState] = {}
        self._dead_reason: str | None = None
        self._recent_batches: list[BatchStat] = []
        self._in_flight: deque[tuple[Batch, float]] = deque()  # submitted, not collected; oldest first
        self._depth = max(1, limits.in_flight)
        self._last_collected = 0.0

    @property
    def has_work(self) -> bool:
        """Whether items are queued or batches are with the workers (the process loop then polls without waiting)."""
        return self._scheduler.num_queued > 0 or bool(self._in_flight)

    @property
    def has_unreported_batches(self) -> bool:
        """Whether batches finished since the last `status()` (the process loop then sends a status message)."""
        return bool(self._recent_batches)

    def add_request(self, msg: WorkRequestMsg, buffers: list[memoryview]) -> list[Outgoing]:
        """Queue a request's items; the messages to send now (an error, or the answer of an empty request)."""
        if self._dead_reason is not None:
            return [_error(msg.request_id, 503, f"{UNAVAILABLE}: {self._dead_reason}")]
        problem = self._validate(msg, buffers)
        if problem is not None:
            return [_error(msg.request_id, 400, problem)]
        if msg.request_id in self._requests:
            return [_error(msg.request_id, 400, f"duplicate request id {msg.request_id}")]
        if not msg.items:
            return [(WorkResultMsg(msg.request_id), [])]
        self._requests[msg.request_id] = _RequestState(len(msg.items))
        self._scheduler.add(
            [QueuedItem(msg.request_id, i, item, buf) for i, (item, buf) in enumerate(zip(msg.items, buffers))]
        )
        return []

    def abort(self, msg: AbortRequestMsg) -> list[Outgoing]:
        """Drop the request's queued items (those listed, or all); answer it now if nothing of it is left to run,
        else when the batch holding the rest ends. Unknown (already answered) requests are ignored."""
        state = self._requests.get(msg.request_id)
        if state is None:
            return []
        indices = set(msg.items) if msg.items is not None else None
        state.dropped |= self._scheduler.drop_items(msg.request_id, indices)
        return self._answer_if_done(msg.request_id, state)

    def step(self) -> list[Outgoing]:
        """Hand batches to the workers until `in_flight` are there, then finish the oldest; return the requests it
        finished (or failed)."""
        reason = self._executor.check_workers()
        if reason is not None:
            return self._fail_all(reason)
        while len(self._in_flight) < self._depth and (batch := self._scheduler.next_batch()) is not None:
            try:
                self._executor.submit(batch)
            except WorkersDeadError as e:
                return self._fail_batch(batch, 503, str(e)) + self._fail_all(str(e))
            self._in_flight.append((batch, time.perf_counter()))
        if not self._in_flight:
            return []
        batch, submitted = self._in_flight.popleft()
        start = max(submitted, self._last_collected)  # the workers start it once the one before is done
        try:
            output = self._executor.collect(batch)
        except WorkersDeadError as e:
            return self._fail_batch(batch, 503, str(e)) + self._fail_all(str(e))
        except BatchFailedError as e:
            self._last_collected = time.perf_counter()
            logger.warning("batch %d failed: %s", batch.batch_id, e)
            return self._fail_batch(batch, 500, f"batch failed: {e}")
        self._last_collected = time.perf_counter()
        stat = BatchStat(
            (batch.kind,),
            len(batch.entries),
            batch.cost,
            time.perf_counter() - start,
            output.compute_seconds,
            output.write_seconds,
        )
        self._recent_batches.append(stat)
        return self._complete(batch, output.items, stat)

    def status(self) -> EngineStatusMsg:
        """The engine's health, queue, workers and the batches finished since the last call (which it then forgets)."""
        batches, self._recent_batches = self._recent_batches, []
        return EngineStatusMsg(
            healthy=self._dead_reason is None,
            reason=self._dead_reason or "",
            queued_items=self._scheduler.num_queued,
            running_items=sum(s.open_items for s in self._requests.values()),
            workers=self._executor.workers(),
            batches=batches,
        )

    def _complete(self, batch: Batch, outputs: list[ItemResult], stat: BatchStat) -> list[Outgoing]:
        done: list[Outgoing] = []
        for entry, output in zip(batch.entries, outputs):
            state = self._requests.get(entry.request_id)
            if state is None:  # the request already failed
                continue
            state.results[entry.index] = output
            if stat not in state.batches:
                state.batches.append(stat)
            done += self._answer_if_done(entry.request_id, state)
        return done

    def _answer_if_done(self, request_id: str, state: _RequestState) -> list[Outgoing]:
        """The request's one answer once every item is finished, failed or dropped (so no batch of it still runs
        or writes its regions): all results, or the finished ones with its batch's error, or (something was
        dropped) with a 499 error."""
        if state.open_items > 0:
            return []
        del self._requests[request_id]
        finished = [state.results[i] for i in sorted(state.results)]
        # its time here outside its own batches: waiting for them to start
        queued = max(0.0, time.perf_counter() - state.arrived - sum(b.seconds for b in state.batches))
        if state.error is not None:
            status, reason = state.error
            return [(WorkResultMsg(request_id, finished, reason, status, state.batches, queued), [])]
        if not state.dropped:
            return [(WorkResultMsg(request_id, finished, batches=state.batches, queue_seconds=queued), [])]
        reason = f"request aborted: {len(state.dropped)} of {state.num_items} items dropped before they ran"
        return [(WorkResultMsg(request_id, finished, reason, ABORTED_STATUS, state.batches, queued), [])]

    def _fail_batch(self, batch: Batch, status: int, reason: str) -> list[Outgoing]:
        """The batch ended without output: its requests fail, their queued items are dropped, and each is answered
        once its other batches in flight have ended too (the router frees every region of a request on its answer,
        so none may still be written then)."""
        failed: list[Outgoing] = []
        for entry in batch.entries:
            state = self._requests.get(entry.request_id)
            if state is not None:
                state.failed.add(entry.index)
                state.error = state.error or (status, reason)
        for request_id in dict.fromkeys(e.request_id for e in batch.entries):
            state = self._requests.get(request_id)
            if state is not None:
                state.dropped |= self._scheduler.drop_items(request_id)
                failed += self._answer_if_done(request_id, state)
        return failed

    def _fail_all(self, reason: str) -> list[Outgoing]:
        if self._dead_reason is None:
            logger.error("engine unhealthy: %s", reason)
        self._dead_reason = reason
        self._in_flight.clear()
        failed = [_error(rid, 503, f"{UNAVAILABLE}: {reason}") for rid in self._requests]
        for rid in list(self._requests):
            self._scheduler.drop_request(rid)
        self._requests.clear()
        return failed

    def _validate(self, msg: WorkRequestMsg, buffers: list[memoryview]) -> str | None:
        if len(buffers) != len(msg.items):
            return f"{len(msg.items)} items but {len(buffers)} input buffers"
        for item, buf in zip(msg.items, buffers):
            if item.cost < 1:
                return f"item {item.key}: cost {item.cost} must be positive"
            if item.input_dtype not in INPUT_DTYPES:
                return f"item {item.key}: input dtype {item.input_dtype!r} is not one of {sorted(INPUT_DTYPES)}"
            if (problem := self._validate_item(item, buf.nbytes)) is not None:
                return problem
        return None


def _error(request_id: str, status: int, reason: str) -> Outgoing:
    return WorkResultMsg(request_id, error=reason, status=status), []
