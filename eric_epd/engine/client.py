"""EngineClient: the router's async handle on the engine process (ZMQ ipc, msgspec, one future per request)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import zmq
import zmq.asyncio

from eric_epd.config import EricConfig
from eric_epd.engine.messages import (
    EncodeItem,
    EncodeRequestMsg,
    EncodeResultMsg,
    EngineStatusMsg,
    Op,
    ShutdownMsg,
    decode_frames,
    encode_frames,
)

logger = logging.getLogger(__name__)

EncodeOutput = tuple[EncodeResultMsg, list[memoryview]]


class EngineUnavailableError(Exception):
    """The engine cannot take work now; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class EngineClient:
    """Submits requests, matches results to futures, and fails everything pending if the engine dies."""

    def __init__(self, config: EricConfig, is_engine_alive: Callable[[], bool],
                 on_status: Callable[[EngineStatusMsg], None] | None = None) -> None:
        self._config = config
        self._is_engine_alive = is_engine_alive
        self._on_status = on_status
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.connect(config.engine_input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.connect(config.engine_output_addr)
        self._pending: dict[str, tuple[asyncio.Future[EncodeOutput], int]] = {}
        self._status_waiters: list[asyncio.Future[EngineStatusMsg]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_reason: str | None = None

    @property
    def num_inflight_items(self) -> int:
        return sum(n for _, n in self._pending.values())

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watchdog())]

    async def encode(self, items: Sequence[EncodeItem], pixels: Sequence[np.ndarray]) -> EncodeOutput:
        """Encode items (float32 pixel arrays); raise EngineUnavailableError when it cannot."""
        if self._dead_reason is not None:
            raise EngineUnavailableError(503, f"encoder unavailable: {self._dead_reason}")
        limit = self._config.batch.max_queued_items
        if self.num_inflight_items + len(items) > limit:
            raise EngineUnavailableError(503, f"encoder queue full ({limit} items); retry later", retry_after=1.0)
        request_id = uuid.uuid4().hex
        future: asyncio.Future[EncodeOutput] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, len(items))
        try:
            frames = encode_frames(Op.ENCODE, EncodeRequestMsg(request_id, list(items)),
                                   [memoryview(np.ascontiguousarray(p, dtype=np.float32)) for p in pixels])
            await self._input.send_multipart(frames, copy=False)
            return await asyncio.wait_for(asyncio.shield(future), self._config.request_timeout_s)
        except TimeoutError as e:
            raise EngineUnavailableError(504, f"encode timed out after {self._config.request_timeout_s}s") from e
        finally:
            self._pending.pop(request_id, None)

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
        return self._dead_reason

    async def _read_loop(self) -> None:
        while True:
            frames = await self._output.recv_multipart(copy=False)
            try:
                op, msg, buffers = decode_frames(frames)
            except Exception:
                logger.exception("undecodable message from the engine")
                continue
            if op is Op.RESULT and isinstance(msg, EncodeResultMsg):
                entry = self._pending.get(msg.request_id)
                if entry is not None and not entry[0].done():
                    entry[0].set_result((msg, buffers))
            elif op is Op.STATUS and isinstance(msg, EngineStatusMsg):
                self._handle_status(msg)

    def _handle_status(self, msg: EngineStatusMsg) -> None:
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
                self._fail_all("engine process died")

    def _fail_all(self, reason: str) -> None:
        self._dead_reason = self._dead_reason or reason
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(EngineUnavailableError(503, f"encoder unavailable: {reason}"))

    async def close(self) -> None:
        """Tell the engine to stop, then close sockets; idempotent."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if not self._input.closed:
            with contextlib.suppress(zmq.ZMQError):
                await asyncio.wait_for(
                    self._input.send_multipart(encode_frames(Op.SHUTDOWN, ShutdownMsg("router stopping"))), 1.0)
            self._input.close(linger=500)
            self._output.close(linger=0)
            self._ctx.term()
