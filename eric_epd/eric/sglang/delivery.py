"""Where an encoded SGLang part goes: pushed over ZMQ to the prefill's tokenizer or to its registered ranks (errors
too, as SGLang's encoder sends them), and the Mooncake and NIXL engines that write parts into ranks' buffers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from eric_epd.eric.config import EricConfig, SglangConfig
from eric_epd.eric.sglang.parts import PartTable
from eric_epd.eric.sglang.protocol import Part, SglangError, as_sglang_error, host_port
from eric_epd.eric.sglang.push import MooncakePusher, NixlPusher
from eric_epd.eric.sglang.rows import PartRows
from eric_epd.eric.sglang.zmq_push import ZmqSender, all_sent
from eric_epd.transfer.producer import TransferHub

logger = logging.getLogger(__name__)


class PartDelivery:
    """The transports of one Eric's SGLang parts: the ZMQ sender (opened by `start`, on the event loop) and the
    Mooncake and NIXL push engines (made on first use); `spawn` runs a background task of the encoder's."""

    def __init__(
        self,
        config: EricConfig,
        hub: TransferHub,
        settings: SglangConfig,
        table: PartTable,
        rows: PartRows,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any]],
    ) -> None:
        self.config = config
        self.hub = hub
        self.settings = settings
        self.table = table
        self.rows = rows
        self._spawn = spawn
        self._zmq: ZmqSender | None = None
        self._mooncake: MooncakePusher | None = None
        self._nixl: NixlPusher | None = None
        self._engine_lock = asyncio.Lock()

    def start(self) -> None:
        """Open the ZMQ sender; call on the event loop."""
        self._zmq = ZmqSender(self.settings.send_timeout_s, self.settings.max_receivers, self.settings.receiver_idle_s)

    def close(self) -> None:
        """Close the ZMQ sender and the push engines."""
        if self._zmq is not None:
            self._zmq.close()
        for engine in (self._mooncake, self._nixl):
            if engine is not None:
                try:
                    engine.close()
                except Exception:
                    logger.exception("closing an SGLang push engine")

    def expire(self) -> None:
        """Close the receiver sockets idle past their timeout."""
        if self._zmq is not None:
            self._zmq.expire()

    @property
    def receivers(self) -> int:
        """Receiver sockets cached now."""
        return len(self._zmq) if self._zmq is not None else 0

    # -------------------------------------------------------------------------------------------------------- ZMQ

    async def send(self, endpoint: str, frames: list[Any], cached: bool) -> None:
        """Push `frames` to a rank's ZMQ endpoint (over a cached socket if `cached`); 503 before `start`."""
        if self._zmq is None:
            raise SglangError(503, "encoder not started")
        await self._zmq.push(endpoint, frames, cached)

    def _frames(self, part: Part) -> list[Any]:
        header = self.rows.header(part)
        return [header] if part.error is not None else [header, self.rows.payload(part)]

    async def deliver_direct(self, part: Part) -> None:
        """zmq_to_tokenizer (or a /encode naming scheduler ports itself): push, release, then answer."""
        req = part.request
        assert req is not None
        ports = req.embedding_port if isinstance(req.embedding_port, list) else [req.embedding_port]
        if not req.prefill_host:
            self.table.release(part)
            raise SglangError(400, "embedding_port given without prefill_host")
        part.active += 1
        try:
            with as_sglang_error(f"[{part.req_id}] embedding delivery failed"), self.rows.reading(part):
                frames = self._frames(part)
                sends = [self.send(host_port(req.prefill_host, int(p)), frames, cached=False) for p in ports]
                failed = [e for e in await all_sent([asyncio.ensure_future(s) for s in sends]) if e is not None]
                if failed:  # only now: no send still reads the part's rows, which `release` frees
                    raise failed[0]
        finally:
            part.active -= 1
            self.table.release(part)

    async def deliver_registered(self, part: Part) -> None:
        """zmq_to_scheduler: push to every registered rank (as they come, up to `receive_count`), then release."""
        part.delivering = True
        tasks: list[tuple[str, asyncio.Task[None]]] = []
        part.active += 1
        try:
            with self.rows.reading(part):
                try:
                    failure, code = await self._push_as_ranks_come(part, self._frames(part), tasks)
                finally:  # cancelled too: no send may still read the rows once `reading` ends
                    results = await all_sent([t for _, t in tasks])
                failed = [ep for (ep, _), r in zip(tasks, results) if r is not None]
                for (ep, _), r in zip(tasks, results):
                    if r is not None:
                        logger.error("SGLang part %s: send to %s failed: %r", part.req_id, ep, r)
                if failed and failure is None:
                    failure = f"delivery failed for {failed}"
        finally:
            part.active -= 1
            part.delivering = False
            self.table.release(part)
        if failure is not None and part.error is None:
            raise SglangError(code, f"[{part.req_id}] embedding delivery failed: {failure}")

    async def _push_as_ranks_come(
        self, part: Part, frames: list[Any], tasks: list[tuple[str, asyncio.Task[None]]]
    ) -> tuple[str | None, int]:
        """Start a push to each rank as it registers, into `tasks`, until `receive_count` have or the send timeout
        passed: (why it stopped short, its status) or (None, 502)."""
        deadline = time.monotonic() + self.settings.send_timeout_s
        sent: set[str] = set()
        while True:
            part.changed.clear()
            for endpoint in sorted(part.destinations.keys() - sent):
                sent.add(endpoint)
                tasks.append((endpoint, asyncio.create_task(self.send(endpoint, frames, cached=True))))
            if part.expected is not None and len(sent) >= part.expected:
                return None, 502
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timeout = self.settings.send_timeout_s
                return f"timed out after {timeout:g}s with {len(sent)}/{part.expected} destination(s) initiated", 504
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(part.changed.wait(), remaining)

    def deliver_error(self, part: Part) -> None:
        """As SGLang's encoder does: ranks waiting on ZMQ get the error as a part message (in the background)."""

        async def tokenizer() -> None:
            with contextlib.suppress(Exception):
                await self.deliver_direct(part)

        async def scheduler() -> None:
            if part.mode is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(part.mode_set.wait(), self.settings.send_timeout_s)
            if part.mode == "scheduler":
                with contextlib.suppress(Exception):
                    await self.deliver_registered(part)
            elif part.mode != "pull":  # pull ranks read the error from /scheduler_receive_meta_data
                self.table.release(part)

        self._spawn(tokenizer() if part.mode == "tokenizer" else scheduler())

    # --------------------------------------------------------------------------------------------- push engines

    async def pusher(self, kind: str) -> Any:
        """The push engine of `kind` ("mooncake", else NIXL) over the pool's memory, made on first use."""
        async with self._engine_lock:
            pool, tc = self.hub.pool, self.config.transfer
            if kind == "mooncake":
                if self._mooncake is None:
                    self._mooncake = await asyncio.to_thread(
                        MooncakePusher,
                        tc.advertise_host,
                        self.config.sglang.mooncake_protocol,
                        tc.mooncake_device,
                        pool.base_addr,
                        pool.nbytes,
                    )
                return self._mooncake
            if self._nixl is None:
                self._nixl = await asyncio.to_thread(
                    NixlPusher, f"eric-sglang-{self.config.instance_id}", pool.base_addr, pool.nbytes
                )
            return self._nixl
