"""SGLang 0.5.23's encoder-server protocol on Eric: the routes a `--language-only --encoder-urls` prefill calls,
mounted in Eric's own app so parts leave straight from the embedding pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import numpy as np
import zmq
import zmq.asyncio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from eric_epd.config import EricConfig
from eric_epd.plugins.sglang.push import MooncakePusher, NixlPusher, PushError
from eric_epd.plugins.sglang.wire import (
    EmbeddingPart,
    EncodeRequest,
    MetaRequest,
    ReceiveUrlRequest,
    RegisterBody,
    SendRequest,
    decode_nixl_session,
    embedding_data_pickle,
)
from eric_epd.server.service import ApiError, EncodeService, ItemAnswer, ItemRequest
from eric_epd.transfer.producer import PoolFullError, TransferHub

logger = logging.getLogger(__name__)

# SGLang's encoder health probe image (http_server.MINIMUM_PNG_PICTURE_BASE64): a 32x32 black PNG.
HEALTH_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAYAAABzenr0AAAACXBIWXMAAA7EAAAOxAGVKw4bAAAAbUlEQVRYhe3VsQ2AMAx"
    "E0Y/lIgNQULD/OqyCMgCihCKSG4yRuKuiNH6JLsoEbMACOGBcua9HOR7Y6w6swBwMy0qLTpkeI77qdEBpBFAHBBDAGH8WrwJKI4AAegUCfAKgEgpQDvh3CR3oQ"
    "Cuav58qlAw73kKCSgAAAABJRU5ErkJggg=="
)
_MODALITIES = {"IMAGE": "image", "VIDEO": "video"}
_URL_SCHEMES = ("http://", "https://", "data:", "file://")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value.strip() else default


@dataclass(frozen=True)
class SglangSettings:
    """Read from the environment (Eric's CLI has no SGLang flags); timeouts use SGLang's own variable names."""

    enabled: bool = True
    register_urls: tuple[str, ...] = ()
    """SGLang EncoderBootstrapServer URLs to register with (ERIC_SGLANG_REGISTER_URLS, space or comma separated)."""
    send_timeout_s: float = 180.0
    """How long a finished part waits for its ranks (SGLANG_ENCODER_SEND_TIMEOUT)."""
    req_timeout_s: float = 180.0
    """How long a rank's early call waits for the part's /encode (SGLANG_ENCODER_REQ_TIMEOUT)."""
    register_retry_s: float = 5.0
    register_attempts: int = 30
    dtype: str = "auto"
    """dtype of the rows sent (ERIC_SGLANG_DTYPE): must be the prefill's model dtype, since mooncake/NIXL landing
    buffers are read in it. "auto" applies SGLang's own --dtype auto rule to the checkpoint (float32 -> float16)."""

    @classmethod
    def from_env(cls) -> SglangSettings:
        urls = os.environ.get("ERIC_SGLANG_REGISTER_URLS", "").replace(",", " ").split()
        return cls(
            enabled=os.environ.get("ERIC_SGLANG", "1").strip().lower() not in ("0", "false", "no", "off"),
            register_urls=tuple(u.rstrip("/") for u in urls),
            send_timeout_s=_env_float("SGLANG_ENCODER_SEND_TIMEOUT", cls.send_timeout_s),
            req_timeout_s=_env_float("SGLANG_ENCODER_REQ_TIMEOUT", cls.req_timeout_s),
            register_retry_s=_env_float("ERIC_SGLANG_REGISTER_RETRY", cls.register_retry_s),
            dtype=os.environ.get("ERIC_SGLANG_DTYPE", "").strip() or cls.dtype,
        )


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def wire_dtype(setting: str, model_cfg: dict[str, Any]) -> str:
    """The dtype SGLang's prefill runs the model in, by its own --dtype auto rule (model_config._get_and_verify_dtype:
    the checkpoint's dtype, but float16 for a float32 checkpoint), unless set explicitly."""
    if setting != "auto":
        if setting not in _ELEMENT_BYTES:
            raise ValueError(f"ERIC_SGLANG_DTYPE must be auto, float32, bfloat16 or float16, not {setting!r}")
        return setting
    text = model_cfg.get("text_config") or {}
    declared = str(model_cfg.get("dtype") or model_cfg.get("torch_dtype") or text.get("dtype")
                   or text.get("torch_dtype") or "float32").removeprefix("torch.")
    if declared in ("float32", "float"):
        return "float16"
    return declared if declared in _ELEMENT_BYTES else "float16"


class SglangError(Exception):
    """Answered as SGLang's encoder answers: {"status": "error", "message", "req_id"} with this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str, req_id: str | None) -> JSONResponse:
    return JSONResponse({"status": "error", "message": message, "req_id": req_id}, status)


def _decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as e:
        raise SglangError(400, f"invalid {kind.__name__} body: {e}") from e


def _tcp(endpoint: str) -> str:
    """"host:port" (IPv6 in brackets) as a ZMQ tcp endpoint."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise SglangError(400, f"bad receive endpoint {endpoint!r}; expected host:port")
    return f"tcp://{host}:{port}"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def item_url(item: str | dict[str, Any], index: int) -> str:
    """SGLang's mm_item (a URL, data URL, local path or raw base64; or {"url", ...options}) as an Eric media URL."""
    if isinstance(item, dict):
        options = sorted(k for k, v in item.items() if k not in ("url", "content_hash", "modality") and v is not None)
        if options:
            raise SglangError(400, f"mm_items[{index}]: per-item options {options} are not supported by Eric "
                                   "(it preprocesses with the checkpoint's processor settings)")
        url = item.get("url")
    else:
        url = item
    if not isinstance(url, str) or not url:
        raise SglangError(400, f"mm_items[{index}] has no url")
    if url.startswith(_URL_SCHEMES):
        return url
    if url.startswith("/"):
        return "file://" + url  # Eric serves files only under its --file-root directories
    return "data:application/octet-stream;base64," + url  # SGLang's loaders take bare base64 too


def validate(req: EncodeRequest, max_items: int) -> None:
    """The checks of SGLang's runtime.validate_encode_request, with its messages."""
    if not req.req_id:
        raise SglangError(400, "missing or invalid req_id")
    if req.modality.upper() not in ("IMAGE", "VIDEO", "AUDIO"):
        raise SglangError(400, f"unsupported modality: {req.modality}")
    if req.modality.upper() not in _MODALITIES:
        raise SglangError(400, f"unsupported modality: {req.modality} (Eric encodes images and videos)")
    if not req.mm_items:
        raise SglangError(400, "missing or empty mm_items")
    if len(req.mm_items) > max_items:
        raise SglangError(400, f"too many mm_items: {len(req.mm_items)} > {max_items}")
    if req.num_parts <= 0:
        raise SglangError(400, "num_parts must be a positive integer")
    if not 0 <= req.part_idx < req.num_parts:
        raise SglangError(400, f"part_idx must be in [0, {req.num_parts})")


@dataclass
class Part:
    """One encoder part (SGLang req_id "<rid>_local_part_<i>") from its first sighting until it is released."""

    req_id: str
    touched: float = field(default_factory=time.monotonic)
    request: EncodeRequest | None = None
    answers: list[ItemAnswer] | None = None
    error: tuple[str, int] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the encode finished, successfully (answers) or not (error)."""
    mode: str | None = None
    """"tokenizer", "scheduler" (zmq_to_scheduler) or "pull" (mooncake / NIXL), fixed by the first caller."""
    mode_set: asyncio.Event = field(default_factory=asyncio.Event)
    destinations: set[str] = field(default_factory=set)
    expected: int | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    sent_to: set[str] = field(default_factory=set)
    active: int = 0
    released: bool = False
    delivering: bool = False
    acked: bool = False
    staged: str | None = None
    """Pool key of the part's rows converted to the wire dtype (one contiguous entry), when Eric's dtype differs."""
    wire_bytes: int = 0

    def set_mode(self, mode: str) -> None:
        if self.mode is None:
            self.mode = mode
            self.mode_set.set()
        elif self.mode != mode:
            raise SglangError(400, f"req_id={self.req_id} is already served as {self.mode}, not {mode}: "
                                   "every prefill rank must use the same --encoder-transfer-backend")

    @property
    def tokens(self) -> int:
        return sum(a.handle.shape[0] for a in self.answers or ())


class SglangEncoder:
    """The protocol state of one Eric: parts by req_id, the ZMQ context and the push engines.

    Endpoints, bodies, status codes and error bodies ({"status": "error", "message", "req_id"}) are those of
    sglang/srt/disaggregation/encoder/http_server.py. Which transfer a prefill uses is told by what it calls:

    - zmq_to_tokenizer: /encode carries `embedding_port`; the part is pushed there before /encode answers.
    - zmq_to_scheduler: every TP rank POSTs /scheduler_receive_url; /encode answers once all `receive_count`
      ranks got the part (or with 502/504, as SGLang's encoder does).
    - mooncake (and NIXL, see plugin.py): ranks pull sizes from /scheduler_receive_meta_data, then POST /send
      with their session and buffer address; Eric writes there and notifies the rank over ZMQ.

    ZMQ frames point into the shared-memory pool; Mooncake and NIXL write from its registered memory. Eric never
    unpickles anything; the only pickle it writes is the allowlisted part header (wire.py).
    """

    def __init__(self, config: EricConfig, hub: TransferHub, state: dict[str, Any], settings: SglangSettings,
                 dim: int, eric_dtype: str, wire: str, model_type: str, temporal_patch_size: int) -> None:
        self.config = config
        self.hub = hub
        self._state = state
        self.settings = settings
        self.dim = dim
        self.eric_dtype = eric_dtype
        self.dtype = wire
        """What the part header announces and the rows are in (the prefill's model dtype)."""
        if wire != eric_dtype:
            import torch  # noqa: F401  (parts are converted: load it now, not at the first request)

            logger.info("SGLang parts are sent as %s (Eric computes %s)", wire, eric_dtype)
        self.model_type = model_type
        self.temporal_patch_size = temporal_patch_size
        self.parts: dict[str, Part] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._socket_locks: dict[str, asyncio.Lock] = {}
        self._mooncake: MooncakePusher | None = None
        self._nixl: NixlPusher | None = None
        self._engine_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def service(self) -> EncodeService:
        service = self._state.get("service")
        if service is None:
            raise SglangError(503, "encoder not ready")
        return service

    # ---------------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._zmq = zmq.asyncio.Context()
        self._spawn(self._sweep_loop())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for key in list(self.parts):
            self._release(self.parts[key], force=True)
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        if self._zmq is not None:
            self._zmq.term()
        for engine in (self._mooncake, self._nixl):
            if engine is not None:
                try:
                    engine.close()
                except Exception:
                    logger.exception("closing an SGLang push engine")

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def part(self, req_id: str, create: bool = True) -> Part | None:
        part = self.parts.get(req_id)
        if part is None and create:
            part = self.parts[req_id] = Part(req_id)
        if part is not None:
            part.touched = time.monotonic()
        return part

    def _release(self, part: Part, force: bool = False) -> None:
        """Drop the part and acknowledge its leases (once per distinct pool entry), unless a transfer still reads."""
        if part.released or (part.active and not force):
            return
        part.released = True
        if self.parts.get(part.req_id) is part:
            del self.parts[part.req_id]
        if part.staged is not None:
            self.hub.release(part.staged)
        self._ack(part)

    def _ack(self, part: Part) -> None:
        """Return Eric's leases (once per distinct pool entry); idempotent."""
        if part.acked:
            return
        part.acked = True
        seen = set()
        for answer in part.answers or ():
            h = answer.handle
            if (h.hash, h.generation) in seen:
                continue
            seen.add((h.hash, h.generation))
            status, message = self.hub.ack(h.hash, h.instance_id, h.generation)
            if status != 200:
                logger.debug("ack of %s for %s: %s", h.hash[:12], part.req_id, message)

    async def _sweep_loop(self) -> None:
        """Parts no rank came for (or whose /encode never came) are released after SGLang's timeouts."""
        while True:
            await asyncio.sleep(max(0.05, min(self.settings.send_timeout_s, self.settings.req_timeout_s) / 4))
            now = time.monotonic()
            for part in list(self.parts.values()):
                limit = self.settings.send_timeout_s if part.request is not None else self.settings.req_timeout_s
                if not part.active and not part.delivering and now - part.touched > limit:
                    logger.warning("SGLang part %s released unclaimed after %.0f s", part.req_id, now - part.touched)
                    self._release(part)

    # ------------------------------------------------------------------------------------------------------ encode

    async def encode(self, req: EncodeRequest) -> Any:
        validate(req, self.config.max_items_per_request)
        modality = req.modality.upper()
        items = [ItemRequest(str(i), _MODALITIES[modality], item_url(it, i)) for i, it in enumerate(req.mm_items)]
        part = self.part(req.req_id)
        assert part is not None
        if part.request is not None:
            raise SglangError(400, f"duplicate /encode for req_id={req.req_id}")
        part.request = req
        if req.embedding_port is not None:
            part.set_mode("tokenizer")
        try:
            part.answers = await self.service.encode(items)
            await self._stage(part)
        except asyncio.CancelledError:
            part.error = ("encoder request cancelled", 500)
            part.done.set()
            self._release(part)
            raise
        except Exception as e:
            if isinstance(e, ApiError | SglangError):
                status, message = e.status, e.message
            elif isinstance(e, PoolFullError):
                status, message = 503, str(e)
            else:
                status, message = 500, f"{type(e).__name__}: {e}"
            part.error = (message, status)
            part.done.set()
            self._deliver_error(part)  # ranks waiting on ZMQ get it too, as from SGLang's encoder
            raise SglangError(status, message) from e
        part.done.set()
        if part.mode == "tokenizer":
            return await self._deliver_direct(part)
        if part.mode is None:
            try:
                await asyncio.wait_for(part.mode_set.wait(), self.settings.send_timeout_s)
            except asyncio.TimeoutError:
                self._release(part)
                raise SglangError(504, f"[{req.req_id}] embedding delivery failed: no prefill rank asked for the "
                                       f"part within {self.settings.send_timeout_s:g}s") from None
        if part.mode == "scheduler":
            return await self._deliver_registered(part)
        return {"req_id": req.req_id, "num_parts": req.num_parts, "part_idx": req.part_idx,
                "modality": modality, "embedding_size": part.wire_bytes, "embedding_len": part.tokens,
                "embedding_dim": self.dim}

    async def _stage(self, part: Part) -> None:
        """Rows in the wire dtype: Eric's pool entries as they are, or one converted copy in the pool (registered
        with the push engines like every pool byte), after which Eric's own leases are returned."""
        part.wire_bytes = part.tokens * self.dim * _ELEMENT_BYTES[self.dtype]
        if self.dtype == self.eric_dtype:
            return
        import torch

        key = f"sglang-stage:{part.req_id}"
        entry = await self.hub.reserve(key, part.wire_bytes, (part.tokens, self.dim), self.dtype)
        part.staged = key
        src_dtype, offset = getattr(torch, self.eric_dtype), 0
        dst = torch.from_numpy(self.hub.pool.view(entry)).view(getattr(torch, self.dtype))
        for row in self._entries(part, staged=False):
            rows = torch.from_numpy(self.hub.pool.view(row)).view(src_dtype)
            dst[offset: offset + rows.numel()] = rows  # the same rounding as Tensor.to(dtype)
            offset += rows.numel()
        self._ack(part)

    def _entries(self, part: Part, staged: bool = True) -> list[Any]:
        if staged and part.staged is not None:
            entry = self.hub.pool.get(part.staged)
            if entry is None:
                raise SglangError(500, f"staged part {part.req_id} left the pool")
            return [entry]
        entries = []
        for answer in part.answers or ():
            entry = self.hub.pool.get(answer.handle.hash)
            if entry is None or entry.generation != answer.handle.generation:
                raise SglangError(500, f"embedding {answer.handle.hash} left the pool before it was sent")
            entries.append(entry)
        return entries

    def _header(self, part: Part) -> bytes:
        req = part.request
        assert req is not None
        modality = req.modality.upper()
        if part.error is not None:
            return embedding_data_pickle(EmbeddingPart(
                req_id=part.req_id, num_parts=req.num_parts, part_idx=req.part_idx, modality=modality, grid=None,
                dtype=None, shape=None, error_msg=part.error[0], error_code=part.error[1]))
        answers = part.answers or []
        extra: dict[str, list[float]] = {}
        if modality == "VIDEO" and self.model_type == "qwen2_5_vl":  # its M-RoPE spaces frames by time
            extra["second_per_grid_ts"] = [self.temporal_patch_size / self.config.media.video_fps] * len(answers)
        return embedding_data_pickle(EmbeddingPart(
            req_id=part.req_id, num_parts=req.num_parts, part_idx=req.part_idx, modality=modality,
            grid=[list(a.prepared.item.grid_thw) for a in answers], dtype=self.dtype,
            shape=[part.tokens, self.dim], extra=extra))

    def _payload(self, part: Part) -> memoryview | bytes:
        """The part's rows, contiguous: a view of the pool for one entry, a copy for several."""
        views = [self.hub.pool.view(e) for e in self._entries(part)]
        return memoryview(views[0]) if len(views) == 1 else np.concatenate(views).tobytes()

    def _ranges(self, part: Part) -> tuple[list[int], list[int]]:
        entries = self._entries(part)
        return [self.hub.pool.base_addr + e.offset for e in entries], [e.nbytes for e in entries]

    # -------------------------------------------------------------------------------------------------------- ZMQ

    async def _push(self, endpoint: str, frames: list[Any], cached: bool) -> None:
        """Send one part message; returns once ZMQ no longer reads `frames` (they may point into the pool)."""
        timeout = self.settings.send_timeout_s
        assert self._zmq is not None
        address = _tcp(endpoint)
        if not cached:
            sock = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(address)
            tracker = None
            try:
                tracker = await asyncio.wait_for(sock.send_multipart(frames, copy=False, track=True), timeout)
                await asyncio.to_thread(tracker.wait, timeout)
            except BaseException:
                sock.close(linger=0)  # drop what was queued: its frames may point into the pool
                if tracker is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(tracker.wait, 1.0)
                raise
            sock.close(linger=5000)
            return
        lock = self._socket_locks.setdefault(address, asyncio.Lock())
        async with lock:
            sock = self._sockets.get(address)
            if sock is None:
                sock = self._zmq.socket(zmq.PUSH)
                sock.setsockopt(zmq.IMMEDIATE, 1)
                sock.connect(address)
                self._sockets[address] = sock
            try:
                tracker = await asyncio.wait_for(sock.send_multipart(frames, copy=False, track=True), timeout)
            except BaseException:
                self._sockets.pop(address, None)
                sock.close(linger=0)
                raise
        await asyncio.to_thread(tracker.wait, timeout)

    def _frames(self, part: Part) -> list[Any]:
        header = self._header(part)
        return [header] if part.error is not None else [header, self._payload(part)]

    async def _deliver_direct(self, part: Part) -> None:
        """zmq_to_tokenizer (or a /encode naming scheduler ports itself): push, release, then answer."""
        req = part.request
        assert req is not None
        ports = req.embedding_port if isinstance(req.embedding_port, list) else [req.embedding_port]
        if not req.prefill_host:
            self._release(part)
            raise SglangError(400, "embedding_port given without prefill_host")
        part.active += 1
        try:
            frames = self._frames(part)
            await asyncio.gather(*(self._push(_host_port(req.prefill_host, int(p)), frames, cached=False)
                                   for p in ports))
        except SglangError:
            raise
        except Exception as e:
            raise SglangError(500, f"[{part.req_id}] embedding delivery failed: {type(e).__name__}: {e}") from e
        finally:
            part.active -= 1
            self._release(part)

    async def _deliver_registered(self, part: Part) -> None:
        """zmq_to_scheduler: push to every registered rank (as they come, up to `receive_count`), then release."""
        part.delivering = True
        deadline = time.monotonic() + self.settings.send_timeout_s
        sent: set[str] = set()
        tasks: list[tuple[str, asyncio.Task[None]]] = []
        failure, code = None, 502
        part.active += 1
        try:
            frames = self._frames(part)
            while True:
                part.changed.clear()
                for endpoint in sorted(part.destinations - sent):
                    sent.add(endpoint)
                    tasks.append((endpoint, asyncio.create_task(self._push(endpoint, frames, cached=True))))
                if part.expected is not None and len(sent) >= part.expected:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    failure = (f"timed out after {self.settings.send_timeout_s:g}s with {len(sent)}/"
                               f"{part.expected} destination(s) initiated")
                    code = 504
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(part.changed.wait(), remaining)
            results = await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
            failed = [ep for (ep, _), r in zip(tasks, results) if isinstance(r, BaseException)]
            for (ep, _), r in zip(tasks, results):
                if isinstance(r, BaseException):
                    logger.error("SGLang part %s: send to %s failed: %r", part.req_id, ep, r)
            if failed and failure is None:
                failure = f"delivery failed for {failed}"
        finally:
            part.active -= 1
            part.delivering = False
            self._release(part)
        if failure is not None and part.error is None:
            raise SglangError(code, f"[{part.req_id}] embedding delivery failed: {failure}")

    def _deliver_error(self, part: Part) -> None:
        """As SGLang's encoder does: ranks waiting on ZMQ get the error as a part message (in the background)."""

        async def tokenizer() -> None:
            with contextlib.suppress(Exception):
                await self._deliver_direct(part)

        async def scheduler() -> None:
            if part.mode is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(part.mode_set.wait(), self.settings.send_timeout_s)
            if part.mode == "scheduler":
                with contextlib.suppress(Exception):
                    await self._deliver_registered(part)
            elif part.mode != "pull":  # pull ranks read the error from /scheduler_receive_meta_data
                self._release(part)

        self._spawn(tokenizer() if part.mode == "tokenizer" else scheduler())

    # ------------------------------------------------------------------------------------------- rank endpoints

    def register_destination(self, req: ReceiveUrlRequest) -> None:
        if req.receive_count <= 0:
            raise SglangError(400, "receive_count must be a positive integer")
        _tcp(req.receive_url)
        part = self.part(req.req_id)
        assert part is not None
        part.set_mode("scheduler")
        if part.expected is None:
            part.expected = req.receive_count
        elif part.expected != req.receive_count:
            raise SglangError(400, f"Inconsistent receive_count for req_id={req.req_id}: registered "
                                   f"{part.expected}, got {req.receive_count}")
        part.destinations.add(req.receive_url)
        part.changed.set()

    async def wait_encoded(self, req_id: str, create: bool) -> Part:
        part = self.part(req_id, create=create)
        if part is None:
            raise SglangError(500, f"no staged embedding for req_id={req_id} (already released)")
        part.set_mode("pull")
        try:
            await asyncio.wait_for(part.done.wait(), self.settings.req_timeout_s)
        except asyncio.TimeoutError:
            raise SglangError(504, "encode metadata not ready") from None
        if part.error is not None:
            raise SglangError(500, part.error[0])
        return part

    async def meta(self, req: MetaRequest) -> dict[str, Any]:
        part = await self.wait_encoded(req.req_id, create=True)
        return {"req_id": req.req_id, "part_idx": req.part_idx, "embedding_size": part.wire_bytes,
                "embedding_len": part.tokens, "embedding_dim": self.dim}

    async def send(self, req: SendRequest) -> None:
        part = await self.wait_encoded(req.req_id, create=False)
        if part.released:
            raise SglangError(500, f"no staged embedding for req_id={req.req_id} (already released)")
        if req.embedding_size is not None and req.embedding_size != part.wire_bytes:
            raise SglangError(400, f"embedding_size {req.embedding_size} != {part.wire_bytes} of req_id={req.req_id}")
        endpoint = _host_port(req.prefill_host, req.embedding_port)
        part.active += 1
        try:
            srcs, lens = self._ranges(part)
            dsts = list(np.cumsum([0, *lens[:-1]], dtype=np.int64) + req.buffer_address) if lens else []
            nixl = decode_nixl_session(req.session_id)
            timeout = self.settings.send_timeout_s
            if nixl is not None:
                pusher: Any = await self._pusher("nixl")
                await asyncio.to_thread(pusher.write, nixl, srcs, [int(d) for d in dsts], lens, timeout)
            elif lens:
                pusher = await self._pusher("mooncake")
                await asyncio.to_thread(pusher.write, req.session_id, srcs, [int(d) for d in dsts], lens, timeout)
            await self._push(endpoint, [self._header(part)], cached=False)
        except PushError as e:
            raise SglangError(500, str(e)) from e
        except SglangError:
            raise
        except Exception as e:
            raise SglangError(500, f"send of req_id={req.req_id} to {endpoint} failed: {type(e).__name__}: {e}") from e
        finally:
            part.active -= 1
        part.sent_to.add(endpoint)
        if req.receive_count and len(part.sent_to) >= req.receive_count:
            self._release(part)

    async def _pusher(self, kind: str) -> Any:
        async with self._engine_lock:
            pool, tc = self.hub.pool, self.config.transfer
            if kind == "mooncake":
                if self._mooncake is None:
                    self._mooncake = await asyncio.to_thread(
                        MooncakePusher, tc.advertise_host, tc.mooncake_protocol, tc.mooncake_device,
                        pool.base_addr, pool.nbytes)
                return self._mooncake
            if self._nixl is None:
                self._nixl = await asyncio.to_thread(
                    NixlPusher, f"eric-sglang-{self.config.instance_id}", pool.base_addr, pool.nbytes)
            return self._nixl

    # -------------------------------------------------------------------------------------------------- health

    async def health_generate(self) -> bool:
        """A real encode of SGLang's own probe image, as its encoder's /health_generate does."""
        try:
            answers = await asyncio.wait_for(self.service.encode([ItemRequest("health", "image", HEALTH_PNG)]), 30)
        except Exception as e:
            logger.error("SGLang health encode failed: %r", e)
            return False
        for h in {(a.handle.hash, a.handle.generation): a.handle for a in answers}.values():
            self.hub.ack(h.hash, h.instance_id, h.generation)
        return True

    # ------------------------------------------------------------------------------------------- registration

    async def register_loop(self, client: httpx.AsyncClient, bootstrap: str) -> None:
        """SGLang's _register_encoder_url_with_bootstrap: retry each bootstrap until it accepts this Eric's URL."""
        body = msgspec.json.encode(RegisterBody(url=self.config.public_url))
        for attempt in range(1, self.settings.register_attempts + 1):
            try:
                resp = await client.post(f"{bootstrap}/register_encoder_url", content=body,
                                         headers={"content-type": "application/json"})
                if resp.status_code == 200:
                    logger.info("registered %s with SGLang bootstrap %s", self.config.public_url, bootstrap)
                    return
                logger.warning("SGLang bootstrap %s answered %d: %s", bootstrap, resp.status_code, resp.text[:200])
            except httpx.HTTPError as e:
                logger.debug("register attempt %d with %s failed: %r", attempt, bootstrap, e)
            await asyncio.sleep(self.settings.register_retry_s)
        logger.error("giving up registering with SGLang bootstrap %s after %d attempts", bootstrap,
                     self.settings.register_attempts)

    async def unregister(self, client: httpx.AsyncClient) -> None:
        body = msgspec.json.encode(RegisterBody(url=self.config.public_url))
        for bootstrap in self.settings.register_urls:
            try:
                await client.request("DELETE", f"{bootstrap}/unregister_encoder_url", content=body,
                                     headers={"content-type": "application/json"}, timeout=2.0)
            except httpx.HTTPError as e:
                logger.debug("unregister from %s failed: %r", bootstrap, e)


def sglang_routes(config: EricConfig, hub: TransferHub, state: dict[str, Any],
                  settings: SglangSettings | None = None) -> APIRouter:
    """The SGLang encoder endpoints over Eric's EncodeService (`state["service"]`, set by Eric's lifespan)."""
    from eric_epd.models.registry import read_model_config
    from eric_epd.server.app import output_spec

    settings = settings or SglangSettings.from_env()
    if not settings.enabled:
        return APIRouter()
    spec = output_spec(config)
    model_cfg = read_model_config(config.model)
    encoder = SglangEncoder(config, hub, state, settings, spec.dim, spec.dtype, wire_dtype(settings.dtype, model_cfg),
                            str(model_cfg.get("model_type", "")),
                            int(model_cfg.get("vision_config", {}).get("temporal_patch_size", 2)))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        encoder.start()
        client = httpx.AsyncClient(timeout=5.0)
        for bootstrap in settings.register_urls:
            encoder._spawn(encoder.register_loop(client, bootstrap))
        try:
            yield
        finally:
            await encoder.unregister(client)
            await encoder.stop()
            await client.aclose()

    router = APIRouter(lifespan=lifespan)

    async def run(request: Request, kind: type[msgspec.Struct], handler: Any) -> Response:
        req_id = None
        try:
            body = _decode(await request.body(), kind)
            req_id = getattr(body, "req_id", None)
            result = await handler(body)
        except SglangError as e:
            if e.status >= 500:
                logger.error("SGLang %s %s: %d %s", request.url.path, req_id, e.status, e.message)
            return _error(e.status, e.message, req_id)
        except Exception as e:  # as SGLang's encoder: any other failure is a 500 naming it
            logger.exception("SGLang %s %s failed", request.url.path, req_id)
            return _error(500, f"{type(e).__name__}: {e}", req_id)
        return JSONResponse(result)

    @router.post("/encode")
    async def encode(request: Request) -> Response:
        return await run(request, EncodeRequest, encoder.encode)

    @router.post("/scheduler_receive_url")
    async def scheduler_receive_url(request: Request) -> Response:
        async def handler(body: ReceiveUrlRequest) -> None:
            encoder.register_destination(body)

        return await run(request, ReceiveUrlRequest, handler)

    @router.post("/scheduler_receive_meta_data")
    async def scheduler_receive_meta_data(request: Request) -> Response:
        return await run(request, MetaRequest, encoder.meta)

    @router.post("/send")
    async def send(request: Request) -> Response:
        return await run(request, SendRequest, encoder.send)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if await encoder.health_generate() else 503)

    router.encoder = encoder  # type: ignore[attr-defined]  # for tests and introspection
    return router
