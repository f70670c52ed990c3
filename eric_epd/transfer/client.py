"""Consumer client used by the engine plugins: fetch an embedding by handle over the best backend, then acknowledge.

Protocol: read the bytes (they stay valid while the lease is held), then POST the ack. A 2xx ack proves the bytes
were the producer's: if the entry expired or the producer restarted before the ack, the ack fails and so does the
fetch, so a consumer never uses memory that was reused underneath it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import numpy as np
import torch

from eric_epd.common.http import bearer
from eric_epd.transfer.backends.base import ConsumerBackend, TransferError
from eric_epd.transfer.regions import ProducerRegions
from eric_epd.wire.handles import BACKENDS, AckAnswer, EmbeddingHandle, ack_request

logger = logging.getLogger(__name__)


def as_handle(handle: EmbeddingHandle | dict[str, Any]) -> EmbeddingHandle:
    """Accept the JSON form /v1/encode returns."""
    return handle if isinstance(handle, EmbeddingHandle) else msgspec.convert(handle, EmbeddingHandle)


@dataclass(frozen=True)
class MooncakeOptions:
    """A consumer's own Mooncake engine: the address peers reach it at, its transport (it must match the
    producer's: Mooncake picks the transport from the target) and its RDMA device names (empty: all)."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    global_cache: str = ""
    """Mooncake Store master (host:port) of the Erics' global cache; empty: no store reads."""


def _usable(backend: ConsumerBackend, handle: EmbeddingHandle) -> bool:
    check = getattr(backend, "usable", None)
    if check is not None:
        return bool(check(handle))
    return getattr(handle, backend.name, None) is not None


def _why_unusable(name: str, backend: ConsumerBackend, handle: EmbeddingHandle) -> str:
    explain = getattr(backend, "why_unusable", None)
    reason = explain(handle) if explain is not None else None
    return f"{name}: {reason or 'this consumer cannot use the handle location'}"


def _make_backend(name: str, http_timeout_s: float, api_key: str | None, mooncake: MooncakeOptions) -> ConsumerBackend:
    if name == "shm":
        from eric_epd.transfer.backends.shm import ShmConsumer

        return ShmConsumer()
    if name == "mooncake":
        from eric_epd.transfer.backends.mooncake import MooncakeConsumer

        return MooncakeConsumer(mooncake.host, mooncake.protocol, mooncake.device)
    if name == "nixl":
        from eric_epd.transfer.backends.nixl import NixlConsumer

        return NixlConsumer(api_key=api_key)
    if name == "http":
        from eric_epd.transfer.backends.http import HttpConsumer

        return HttpConsumer(http_timeout_s, api_key)
    if name == "store":
        from eric_epd.transfer.backends.store import StoreConsumer

        return StoreConsumer(mooncake.global_cache, mooncake.host, mooncake.protocol, mooncake.device)
    raise ValueError(f"unknown transfer backend {name!r}; choose from {BACKENDS}")


def _read(backend: ConsumerBackend, h: EmbeddingHandle, dst: np.ndarray | torch.Tensor) -> None:
    if isinstance(dst, np.ndarray):
        backend.read(h, dst)
        return
    direct = getattr(backend, "read_tensor", None)
    if direct is not None:
        direct(h, dst)
    elif dst.device.type == "cpu":
        backend.read(h, dst.view(torch.uint8).reshape(-1).numpy())
    else:
        host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=True)
        backend.read(h, host.numpy())
        dst.view(torch.uint8).reshape(-1).copy_(host)


def _kept(h: EmbeddingHandle, answer: bytes) -> EmbeddingHandle | None:
    """The handle of the child lease an acknowledgement with `keep` answered, if it did."""
    try:
        child = msgspec.json.decode(answer, type=AckAnswer).lease
    except msgspec.MsgspecError as e:
        logger.warning("the ack of %s answered no readable child lease: %s", h.hash[:12], e)
        return None
    return None if child is None else msgspec.structs.replace(h, lease=child)


class EmbeddingFetcher:
    """Thread-safe; one per consumer process. `backends` lists what this consumer may use, best first; `api_key` is
    the producers' (their control routes need it)."""

    def __init__(
        self,
        backends: Sequence[str] = BACKENDS,
        http_timeout_s: float = 30.0,
        api_key: str | None = None,
        mooncake: MooncakeOptions | None = None,
    ) -> None:
        for name in backends:
            if name not in BACKENDS:
                raise ValueError(f"unknown transfer backend {name!r}; choose from {BACKENDS}")
        self._mooncake = mooncake or MooncakeOptions()
        self._order = tuple(backends) + (("store",) if self._mooncake.global_cache else ())
        self._http_timeout_s = http_timeout_s
        self._api_key = api_key
        self._unusable: Counter[str] = Counter()  # reason -> handles skipped for it since take_unusable()
        self._told: set[str] = set()
        self._backends: dict[str, ConsumerBackend] = {}
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=http_timeout_s, headers=bearer(api_key))
        self._regions = ProducerRegions(self._http)
        self.last_backend: str | None = None

    def _backend(self, name: str) -> ConsumerBackend:
        with self._lock:  # one consumer agent/engine per backend, even when threads race here
            if name not in self._backends:
                self._backends[name] = _make_backend(name, self._http_timeout_s, self._api_key, self._mooncake)
            return self._backends[name]

    def fetch(
        self, handle: EmbeddingHandle | dict[str, Any], out: torch.Tensor | None = None, ack: bool = True
    ) -> torch.Tensor:
        """The embedding as a tensor (written into `out` when given: contiguous, handle.nbytes bytes, any device)."""
        h = as_handle(handle)
        dst = torch.empty(h.shape, dtype=getattr(torch, h.dtype)) if out is None else out
        backend = self.read_into(h, dst)
        if ack:
            self.confirm(h, backend, lambda: self.read_into(h, dst, only="store"))
        return dst

    @property
    def has_store(self) -> bool:
        """Whether the global cache (Mooncake Store) is one of this fetcher's backends."""
        return "store" in self._order

    def confirm(
        self,
        h: EmbeddingHandle,
        backend: str,
        reread: Callable[[], str],
        attempt_timeout_s: float | None = None,
        keep: bool = False,
    ) -> tuple[str, EmbeddingHandle | None]:
        """Acknowledge a read; returns the backend whose bytes stand and, with `keep`, the child lease the producer
        answered in the acknowledged one's place (None if it gave none). Bytes from the producer are its only while
        the lease holds, so a failed ack fails them; then the global cache (when configured) is the second chance
        and `reread` reads them again from there. Bytes from the store are content-addressed: no ack is due (it is
        still sent, best effort, so a producer that lives frees the entry now)."""
        try:
            kept = self.ack(h, attempt_timeout_s, keep=keep)
        except TransferError as e:
            if backend == "store":
                return backend, None
            if not self.has_store:
                raise
            logger.warning("%s; reading %s from the global cache instead", e, h.hash[:16])
            return reread(), None
        return backend, kept

    def register_destination(self, dst: torch.Tensor) -> None:
        """A long-lived destination (a landing area): backends that benefit register it once (NIXL)."""
        if "nixl" not in self._order:
            return
        try:
            self._backend("nixl").register_destination(dst)  # type: ignore[attr-defined]
        except Exception as e:  # reads then register their range one by one
            logger.warning("nixl cannot register the landing area (%r); reads will register per item", e)

    def read_into(self, h: EmbeddingHandle, dst: np.ndarray | torch.Tensor, only: str = "") -> str:
        """Copy the bytes into dst over the first backend that works (`only`: that one); no ack. Returns the
        backend's name. The global cache, when configured, is tried last. Every location the handle offers must
        be its producer's own (HandleError otherwise, before anything is read). `dst`:
        a uint8 array of handle.nbytes, or a contiguous tensor of that many bytes on any device (backends that
        can write device memory do so directly; the others go through a host buffer)."""
        if isinstance(dst, torch.Tensor) and (not dst.is_contiguous() or dst.numel() * dst.element_size() != h.nbytes):
            raise ValueError(f"dst must be a contiguous tensor of {h.nbytes} bytes")
        errors = []
        asked, unusable = False, None  # the producer's word on the handle: asked once, before the first read
        for name in (only,) if only else self._order:
            if name not in self._order:
                raise TransferError(f"transfer backend {name!r} is not configured for this consumer")
            if getattr(h, name, None) is None and name not in ("http", "store"):
                continue
            try:
                backend = self._backend(name)
                if not _usable(backend, h):
                    self._note_unusable(_why_unusable(name, backend, h))
                    continue
                if name != "store":  # the store is content-addressed: it reads no location of the handle
                    if not asked:
                        asked, unusable = True, self._regions.check(h)  # HandleError: a foreign location
                        if unusable:
                            errors.append(unusable)
                    if unusable:
                        continue
                _read(backend, h, dst)
            except (ImportError, OSError) as e:  # the backend's library is missing or cannot start here
                logger.warning("transfer backend %s unavailable: %r", name, e)
                errors.append(f"{name}: unavailable ({e!r})")
                continue
            except TransferError as e:
                logger.warning("fetch of %s over %s failed: %s", h.hash[:12], name, e)
                errors.append(f"{name}: {e}")
                continue
            self.last_backend = name
            return name
        raise TransferError(
            f"could not fetch embedding {h.hash} from {h.producer}: "
            + ("; ".join(errors) or f"no usable backend among {self._order}")
        )

    def _note_unusable(self, reason: str) -> None:
        """A transport the handle offers that this consumer cannot use: said once in the log, always counted."""
        with self._lock:
            self._unusable[reason] += 1
            first = reason not in self._told
            self._told.add(reason)
        if first:
            logger.warning("skipping a transport the producer offers: %s (said once; counted)", reason)

    def take_unusable(self) -> int:
        """Handles whose offered transport was skipped since the last call."""
        with self._lock:
            n, self._unusable = sum(self._unusable.values()), Counter()
        return n

    def ack(
        self, handle: EmbeddingHandle | dict[str, Any], attempt_timeout_s: float | None = None, keep: bool = False
    ) -> EmbeddingHandle | None:
        """Release our lease. Raises TransferError if the entry expired or the producer restarted. With `keep`, the
        handle of the child lease the producer answered in its place (a retry whose first attempt took effect gets
        that attempt's child again, while it holds; None if it gave none: the child lapsed, or the lease may add no
        more children); else None.

        With `attempt_timeout_s`, an unanswered ack is sent again on a new connection (marked as a retry) until the
        fetcher's timeout. The producer answers a retry whose first attempt took effect with a 200 ("already
        acknowledged"), so a 404 always means the lease ended without our ack (it expired or was released first,
        maybe while the first attempt waited unread): the bytes read are not proven the producer's, a failure."""
        h = as_handle(handle)
        deadline = time.monotonic() + self._http_timeout_s
        unanswered = False
        while True:
            timeout = self._http_timeout_s if attempt_timeout_s is None else attempt_timeout_s
            try:
                ack = ack_request(h.producer, h.hash, h.lease, h.instance_id, retry=unanswered, keep=keep)
                resp = self._http.post(
                    ack.url,
                    content=ack.content,
                    headers=ack.headers,
                    timeout=max(0.1, min(timeout, deadline - time.monotonic())),
                )
            except httpx.ReadTimeout as e:
                if attempt_timeout_s is None or time.monotonic() >= deadline:
                    raise TransferError(f"producer {h.producer} did not answer the ack of {h.hash}: {e!r}") from e
                logger.warning("ack of %s unanswered after %.1f s; sending it again", h.hash[:12], timeout)
                unanswered = True
                continue
            except httpx.HTTPError as e:
                raise TransferError(f"producer {h.producer} unreachable for ack of {h.hash}: {e!r}") from e
            if resp.status_code == 200:
                return _kept(h, resp.content) if keep else None
            try:
                message = resp.json()["error"]["message"]
            except Exception:
                message = resp.text[:200]
            if unanswered:
                logger.warning(
                    "ack of %s sent again after an unanswered attempt: the producer no longer holds the "
                    "lease (%d), so it ended without our ack",
                    h.hash[:12],
                    resp.status_code,
                )
            raise TransferError(f"embedding {h.hash} from {h.producer} is no longer valid: {message}")

    def close(self) -> None:
        """Close every backend and the HTTP client."""
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()
        self._http.close()
