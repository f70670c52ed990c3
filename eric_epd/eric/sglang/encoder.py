"""The state machine of SGLang 0.5.23's encoder protocol on Eric: parts by req_id, encoded through Eric's
EncodeService and delivered from the embedding pool over ZMQ, Mooncake or NIXL."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from eric_epd.common.errors import ApiError
from eric_epd.common.to_the_end import to_the_end
from eric_epd.eric.config import EricConfig, SglangConfig
from eric_epd.eric.service import EncodeService
from eric_epd.eric.sglang.delivery import PartDelivery
from eric_epd.eric.sglang.parts import PartTable
from eric_epd.eric.sglang.peers import PeerPolicy
from eric_epd.eric.sglang.protocol import (
    MAX_RANKS,
    MODALITIES,
    Part,
    SglangError,
    as_sglang_error,
    health_item,
    item_url,
    validate,
)
from eric_epd.eric.sglang.rows import PartRows
from eric_epd.transfer.producer import TransferHub
from eric_epd.wire.eric import EncodeItem
from eric_epd.wire.sglang import EncodeRequest, MetaRequest, ReceiveUrlRequest, SendRequest

logger = logging.getLogger(__name__)


class SglangEncoder:
    """The protocol state of one Eric: parts by req_id, the ZMQ context and the push engines.

    Endpoints, bodies, status codes and error bodies ({"status": "error", "message", "req_id"}) are those of
    sglang/srt/disaggregation/encoder/http_server.py. Which transfer a prefill uses is told by what it calls:

    - zmq_to_tokenizer: /encode carries `embedding_port`; the part is pushed there before /encode answers.
    - zmq_to_scheduler: every TP rank POSTs /scheduler_receive_url; /encode answers once all `receive_count`
      ranks got the part (or with 502/504, as SGLang's encoder does).
    - mooncake (and NIXL, see eric_epd/plugins/sglang/plugin.py): ranks pull sizes from
      /scheduler_receive_meta_data, then POST /send with their session and buffer address; Eric writes there and
      notifies the rank over ZMQ.

    ZMQ frames point into the shared-memory pool; Mooncake and NIXL write from its registered memory. Eric never
    unpickles anything; the only pickle it writes is the allowlisted part header (wire/sglang.py).
    """

    def __init__(
        self,
        config: EricConfig,
        hub: TransferHub,
        state: dict[str, Any],
        settings: SglangConfig,
        width: Callable[[str], int],
        eric_dtype: str,
        wire: str,
        modalities: tuple[str, ...] = ("image", "video"),
        video_seconds: float | None = None,
    ) -> None:
        self.config = config
        self.modalities = modalities
        """What the checkpoint's encoder takes (Eric's modality names); other parts get SGLang's 400."""
        self.hub = hub
        self._state = state
        self.settings = settings
        if wire != eric_dtype:
            import torch  # noqa: F401  (parts are converted: load it now, not at the first request)

            logger.info("SGLang parts are sent as %s (Eric computes %s)", wire, eric_dtype)
        self.rows = PartRows(hub, width, eric_dtype, wire, video_seconds)  # width: values per row of a modality
        self.peers = PeerPolicy(settings.peer_networks)
        self.table = PartTable(hub, settings)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.delivery = PartDelivery(config, hub, settings, self.table, self.rows, self._spawn)

    @property
    def service(self) -> EncodeService:
        """The Eric's EncodeService once the server has started; 503 before."""
        service = self._state.get("service")
        if service is None:
            raise SglangError(503, "encoder not ready")
        return service

    # ---------------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Open the ZMQ sender and start the sweep of idle parts and receiver sockets; call on the event loop."""
        self.delivery.start()
        self._spawn(self._sweep_loop())

    async def stop(self) -> None:
        """Cancel the background tasks, release every part, and close the ZMQ sender and the push engines."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.table.close()
        self.delivery.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _sweep_loop(self) -> None:
        """Idle parts and receiver sockets are released after their timeouts."""
        while True:
            await asyncio.sleep(
                max(
                    0.05,
                    min(self.settings.send_timeout_s, self.settings.req_timeout_s, self.settings.receiver_idle_s) / 4,
                )
            )
            self.table.expire()
            self.delivery.expire()

    def state(self) -> dict[str, int]:
        """What the protocol holds now (the eric_sglang_state gauge): parts by req_id, cached receiver sockets."""
        return {"parts": len(self.table), "receivers": self.delivery.receivers}

    # ------------------------------------------------------------------------------------------------------ encode

    async def encode(self, req: EncodeRequest, caller: str | None) -> Any:
        """SGLang's /encode: encode the part's items, stage its rows, then deliver it or answer its sizes by mode."""
        validate(req, self.config.max_items_per_request, self.modalities)
        req = await self.peers.encode_target(req, caller)
        modality = req.modality.upper()
        items = [
            EncodeItem(id=str(i), modality=MODALITIES[modality], url=item_url(it, i))
            for i, it in enumerate(req.mm_items)
        ]
        part = self.table.get(req.req_id)
        assert part is not None
        if part.request is not None:
            raise SglangError(400, f"duplicate /encode for req_id={req.req_id}")
        part.request = req
        self._claim(part, caller)
        if req.embedding_port is not None:
            part.set_mode("tokenizer")
        try:
            part.active += 1  # the sweep leaves it alone while it encodes (an encode may outlast the send timeout)
            try:
                staging = self.rows.staging(part)  # SGLang pads no clip to hops
                part.answers = await self.service.encode(items, sglang=True, staging=staging)
                part.staged = staging.entries[0] if staging is not None and staging.entries else None
                self._stage(part)
            finally:
                part.active -= 1
                part.touched = time.monotonic()  # idle from now: an encode may outlast the timeouts, ranks come after
            if part.released:  # closed while it encoded: what the encode took goes back now
                self.table.release(part)
                raise SglangError(503, f"[{req.req_id}] released while encoding (Eric is stopping)")
        except asyncio.CancelledError:
            part.error = ("encoder request cancelled", 500)
            part.done.set()
            self.table.release(part)
            raise
        except Exception as e:
            if isinstance(e, ApiError):  # SglangError, PoolFullError and the encode's own errors
                status, message = e.status, e.message
            else:
                status, message = 500, f"{type(e).__name__}: {e}"
            part.error = (message, status)
            part.done.set()
            self.delivery.deliver_error(part)  # ranks waiting on ZMQ get it too, as from SGLang's encoder
            raise SglangError(status, message) from e
        part.done.set()
        if part.mode == "tokenizer":
            return await self.delivery.deliver_direct(part)
        if part.mode is None:
            try:
                await asyncio.wait_for(part.mode_set.wait(), self.settings.send_timeout_s)
            except TimeoutError:
                self.table.release(part)
                raise SglangError(
                    504,
                    f"[{req.req_id}] embedding delivery failed: no prefill rank asked for the "
                    f"part within {self.settings.send_timeout_s:g}s",
                ) from None
        if part.mode == "scheduler":
            return await self.delivery.deliver_registered(part)
        return {
            "req_id": req.req_id,
            "num_parts": req.num_parts,
            "part_idx": req.part_idx,
            "modality": modality,
            "embedding_size": part.wire_bytes,
            "embedding_len": part.tokens,
            "embedding_dim": self.rows.dim(part),
        }

    def _claim(self, part: Part, caller: str | None) -> None:
        """The /encode caller owns the part: ranks registered earlier from addresses it may not use are dropped."""
        part.owner = caller
        for endpoint in part.drop_destinations(lambda who: self.peers.allows_caller(who, caller)):
            logger.warning(
                "SGLang part %s: dropped rank %s registered from an address other than %s",
                part.req_id,
                endpoint,
                caller,
            )

    def _stage(self, part: Part) -> None:
        if self.rows.stage(part):
            self.table.ack(part)  # the converted copy is what is sent: Eric's own entries can go

    # ------------------------------------------------------------------------------------------- rank endpoints

    async def register_destination(self, req: ReceiveUrlRequest, caller: str | None) -> None:
        """SGLang's /scheduler_receive_url: record a checked rank endpoint of the part (zmq_to_scheduler)."""
        if req.receive_count <= 0:
            raise SglangError(400, "receive_count must be a positive integer")
        if req.receive_count > MAX_RANKS:
            raise SglangError(400, f"receive_count {req.receive_count} > {MAX_RANKS} ranks")
        endpoint = await self.peers.endpoint(req.receive_url, caller, "receive_url")
        known = self.table.find(req.req_id)
        if known is not None:
            self.peers.check_caller(caller, known.owner, req.req_id)
        part = self.table.get(req.req_id, rank=caller or "")
        assert part is not None
        part.set_mode("scheduler")
        if part.expected is None:
            part.expected = req.receive_count
        elif part.expected != req.receive_count:
            raise SglangError(
                400,
                f"Inconsistent receive_count for req_id={req.req_id}: registered "
                f"{part.expected}, got {req.receive_count}",
            )
        if endpoint not in part.destinations and len(part.destinations) >= part.expected:
            raise SglangError(400, f"req_id={req.req_id} already has its {part.expected} receive_url(s)")
        part.destinations[endpoint] = caller
        part.changed.set()

    async def wait_encoded(self, req_id: str, create: bool, caller: str | None) -> Part:
        """The part once encoded; a req_id never posted (or released) is the caller's error (404), an encode that
        is under way but not done in time is ours (504), a failed encode answers with its own status."""
        part = self.table.get(req_id, create=create, rank=caller or "")
        if part is None:
            raise SglangError(404, f"no staged embedding for req_id={req_id} (never posted or already released)")
        part.set_mode("pull")
        try:
            await asyncio.wait_for(part.done.wait(), self.settings.req_timeout_s)
        except TimeoutError:
            if part.request is None:
                raise SglangError(
                    404, f"no /encode for req_id={req_id} arrived within {self.settings.req_timeout_s:g}s"
                ) from None
            raise SglangError(504, "encode metadata not ready") from None
        if part.error is not None:
            raise SglangError(part.error[1], part.error[0])
        return part

    async def meta(self, req: MetaRequest, caller: str | None) -> dict[str, Any]:
        """SGLang's /scheduler_receive_meta_data: the encoded part's size, token count and width."""
        part = await self.wait_encoded(req.req_id, create=True, caller=caller)
        self.peers.check_caller(caller, part.owner, req.req_id)
        return {
            "req_id": req.req_id,
            "part_idx": req.part_idx,
            "embedding_size": part.wire_bytes,
            "embedding_len": part.tokens,
            "embedding_dim": self.rows.dim(part),
        }

    async def send(self, req: SendRequest, caller: str | None) -> None:
        """SGLang's /send: write the part's rows to the rank's buffer (Mooncake or NIXL), then notify it over ZMQ."""
        endpoint, session, nixl = await self.peers.send_targets(req, caller)
        part = await self.wait_encoded(req.req_id, create=False, caller=caller)
        self.peers.check_caller(caller, part.owner, req.req_id)
        if part.released:
            raise SglangError(404, f"no staged embedding for req_id={req.req_id} (already released)")
        if req.embedding_size is not None and req.embedding_size != part.wire_bytes:
            raise SglangError(400, f"embedding_size {req.embedding_size} != {part.wire_bytes} of req_id={req.req_id}")
        part.active += 1
        try:
            with as_sglang_error(f"send of req_id={req.req_id} to {endpoint} failed"), self.rows.reading(part):
                srcs, lens = self.rows.ranges(part)
                dsts = list(np.cumsum([0, *lens[:-1]], dtype=np.int64) + req.buffer_address) if lens else []
                timeout = self.settings.send_timeout_s
                if nixl is not None:
                    pusher: Any = await self.delivery.pusher("nixl")
                    await to_the_end(asyncio.to_thread(pusher.write, nixl, srcs, [int(d) for d in dsts], lens, timeout))
                elif lens:
                    pusher = await self.delivery.pusher("mooncake")
                    await to_the_end(
                        asyncio.to_thread(pusher.write, session, srcs, [int(d) for d in dsts], lens, timeout)
                    )
                await self.delivery.send(endpoint, [self.rows.header(part)], cached=False)
        finally:
            part.active -= 1
        part.sent_to.add(endpoint)
        if len(part.sent_to) >= min(req.receive_count or MAX_RANKS, MAX_RANKS):
            self.table.release(part)

    # -------------------------------------------------------------------------------------------------- health

    async def health_generate(self) -> bool:
        """A real encode of SGLang's own probe image (silence for an audio model), as its /health_generate does."""
        modality, url = health_item(self.modalities)
        try:
            answers = await asyncio.wait_for(
                self.service.encode([EncodeItem(id="health", modality=modality, url=url)]), 30
            )
        except Exception as e:
            logger.error("SGLang health encode failed: %r", e)
            return False
        for h in {(a.handle.hash, a.handle.generation): a.handle for a in answers}.values():
            self.hub.ack(h.hash, h.lease)
        return True
