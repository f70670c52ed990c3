"""EngineClient: the router's async handle on the engine process (ZMQ ipc, msgspec, one future per request).

A request's pool space may be reused only after the engine's final answer for it (or once the engine is known
dead): workers write into the pool at the reserved offsets until then. Abandoned requests are aborted, not forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import zmq
import zmq.asyncio

from eric_epd.common.errors import ApiError
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.engine.messages import (
    UNAVAILABLE,
    AbortRequestMsg,
    EngineStatusMsg,
    Op,
    ShutdownMsg,
    WorkRequestMsg,
    WorkResultMsg,
    decode_frames,
    encode_frames,
)
from eric_epd.runtime.work import WorkItem

logger = logging.getLogger(__name__)

WorkOutput = tuple[WorkResultMsg, list[memoryview]]


class EngineUnavailableError(ApiError):
    """The engine cannot take work now; `status` is the HTTP status to answer with."""


@dataclass(frozen=True)
class EngineRequest:
    """One request in the engine. `result` resolves with the engine's final answer, or fails with
    EngineUnavailableError once the engine is known dead: only then may its pool space be freed."""

    request_id: str
    num_items: int
    result: asyncio.Future[WorkOutput]


class EngineClient:
    """Submits requests, matches results to futures, and fails everything pending if the engine dies."""

    def __init__(
        self,
        config: RuntimeConfig,
        is_engine_alive: Callable[[], bool],
        on_status: Callable[[EngineStatusMsg], None] | None = None,
    ) -> None:
        self._config = config
        self._is_engine_alive = is_engine_alive
        self._on_status = on_status
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.connect(config.engine_input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.connect(config.engine_output_addr)
        self._pending: dict[str, EngineRequest] = {}
        self._status_waiters: list[asyncio.Future[EngineStatusMsg]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_reason: str | None = None
        self._last_status: EngineStatusMsg | None = None

    @property
    def num_inflight_items(self) -> int:
        """Items submitted to the engine and not yet answered."""
        return sum(r.num_items for r in self._pending.values())

    @property
    def request_timeout_s(self) -> float:
        """How long a request may wait for its engine answer (the configured `request_timeout_s`)."""
        return self._config.request_timeout_s

    def start(self) -> None:
        """Start the tasks that read the engine's answers and watch it stay alive (once, on the event loop)."""
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watchdog())]

    def submit(self, items: Sequence[WorkItem], inputs: Sequence[np.ndarray]) -> EngineRequest:
        """Hand items (input arrays of each item's `input_dtype`) to the engine; raise EngineUnavailableError when it
        cannot take them. Not a coroutine, so a caller cannot be cancelled between sending a request and holding its
        handle."""
        arrays = [np.ascontiguousarray(p) for p in inputs]
        for item, array in zip(items, arrays, strict=True):
            if array.dtype != np.dtype(item.input_dtype):
                raise ValueError(f"item {item.key}: a {array.dtype} input for input dtype {item.input_dtype}")
        self.check_room(len(items))
        request = EngineRequest(uuid.uuid4().hex, len(items), asyncio.get_running_loop().create_future())
        frames = encode_frames(
            Op.SUBMIT, WorkRequestMsg(request.request_id, list(items)), [memoryview(array) for array in arrays]
        )
        self._pending[request.request_id] = request
        try:
            self._send(frames, request)
        except BaseException:  # not a ZMQ error (those fail the request's future): nothing was sent
            self._pending.pop(request.request_id, None)
            raise
        return request

    def check_room(self, count: int) -> None:
        """Raise EngineUnavailableError (503) if the engine is dead or its queue has no room for `count` more items
        (submit checks its own; a caller that must refuse before work it cannot undo checks first)."""
        if self._dead_reason is not None:
            raise EngineUnavailableError(503, f"{UNAVAILABLE}: {self._dead_reason}")
        limit = self._config.batch.max_queued_items
        if self.num_inflight_items + count > limit:
            raise EngineUnavailableError(503, f"engine queue full ({limit} items); retry later", retry_after=1.0)

    def abort(self, request: EngineRequest, items: Sequence[int] | None = None) -> None:
        """Ask the engine to drop the request's queued items at `items` (indices; all when None). Its final answer
        (request.result) still comes, listing what finished anyway."""
        if request.result.done() or request.request_id not in self._pending:
            return
        msg = AbortRequestMsg(request.request_id, sorted(items) if items is not None else None)
        self._send(encode_frames(Op.ABORT, msg))

    def _send(self, frames: list[object], request: EngineRequest | None = None) -> None:
        """Queue frames on the input socket without awaiting: sends stay in order (an ABORT never overtakes its
        ENCODE), and a request that could not be sent fails (the engine never saw it, so nothing writes for it)."""
        try:
            sent = self._input.send_multipart(frames, copy=False)
        except zmq.ZMQError as e:
            self._on_sent(request, e)
            return
        sent.add_done_callback(partial(self._sent_done, request))

    def _sent_done(self, request: EngineRequest | None, sent: asyncio.Future[object]) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            self._on_sent(request, sent.exception())

    def _on_sent(self, request: EngineRequest | None, error: BaseException | None) -> None:
        logger.error("sending to the engine failed: %r", error)
        if (
            request is not None
            and self._pending.pop(request.request_id, None) is not None
            and not request.result.done()
        ):
            request.result.set_exception(EngineUnavailableError(503, f"{UNAVAILABLE}: {error!r}"))

    async def status(self, timeout_s: float = 2.0) -> EngineStatusMsg | None:
        """Ask the engine for its status; None if it does not answer in time."""
        if self._dead_reason is not None:
            return None
        waiter: asyncio.Future[EngineStatusMsg] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(waiter)
        await self._input.send_multipart(encode_frames(Op.STATUS_REQUEST, None))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return None
        finally:
            with contextlib.suppress(ValueError):
                self._status_waiters.remove(waiter)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is considered dead, or None while it is alive."""
        return self._dead_reason

    async def _read_loop(self) -> None:
        while True:
            frames = await self._output.recv_multipart(copy=False)
            try:
                op, msg, buffers = decode_frames(frames)
            except Exception:
                logger.exception("undecodable message from the engine")
                continue
            if op is Op.RESULT and isinstance(msg, WorkResultMsg):
                request = self._pending.pop(msg.request_id, None)
                if request is not None and not request.result.done():
                    request.result.set_result((msg, buffers))
            elif op is Op.STATUS and isinstance(msg, EngineStatusMsg):
                self._handle_status(msg)

    @property
    def last_status(self) -> EngineStatusMsg | None:
        """The engine's latest status message (it sends one after every step that finished batches)."""
        return self._last_status

    def _handle_status(self, msg: EngineStatusMsg) -> None:
        self._last_status = msg
        if self._on_status is not None:
            self._on_status(msg)
        if not msg.healthy:
            self._fail_all(msg.reason)
        for waiter in self._status_waiters:
            if not waiter.done():
                waiter.set_result(msg)

    async def _watchdog(self) -> None:
        while self._dead_reason is None:
            await asyncio.sleep(0.25)
            if not self._is_engine_alive():
                self._fail_all("engine process died (its workers are stopped)")

    def _fail_all(self, reason: str) -> None:
        self._dead_reason = self._dead_reason or reason
        pending, self._pending = self._pending, {}
        for request in pending.values():
            if not request.result.done():
                request.result.set_exception(EngineUnavailableError(503, f"{UNAVAILABLE}: {reason}"))

    async def close(self) -> None:
        """Tell the engine to stop, then close sockets; idempotent."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if not self._input.closed:
            with contextlib.suppress(zmq.ZMQError):
                await asyncio.wait_for(
                    self._input.send_multipart(encode_frames(Op.SHUTDOWN, ShutdownMsg("router stopping"))), 1.0
                )
            self._input.close(linger=500)
            self._output.close(linger=0)
            self._ctx.term()
