"""Producer side of the transfer layer, inside the Eric router: the pool, its backends, leases, acks and expiry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, NamedTuple

from eric_epd.common.errors import ApiError
from eric_epd.transfer.backends.base import ProducerBackend
from eric_epd.transfer.config import TransferConfig
from eric_epd.transfer.pool import MAX_ENDED_LEASES, EmbeddingPool, LeaseError, PoolEntry, span
from eric_epd.wire.handles import EmbeddingHandle, ProducerInfo

logger = logging.getLogger(__name__)


class Want(NamedTuple):
    """One embedding a request needs pool space for."""

    key: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


class PoolFullError(ApiError):
    """No pool space within the configured wait: 503, retry in a second."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, retry_after=1.0)


def create_backends(tc: TransferConfig, pool_name: str, instance_id: str, public_url: str) -> list[ProducerBackend]:
    """Instantiate the configured producer backends (imports are lazy: unused engines need not be installed)."""
    backends: list[ProducerBackend] = []
    for name in tc.backends:
        if name == "shm":
            from eric_epd.transfer.backends.shm import ShmProducer

            backends.append(ShmProducer(pool_name))
        elif name == "mooncake":
            from eric_epd.transfer.backends.mooncake import MooncakeProducer

            backends.append(MooncakeProducer(tc.advertise_host, tc.mooncake_protocol, tc.mooncake_device))
        elif name == "nixl":
            from eric_epd.transfer.backends.nixl import NixlProducer

            backends.append(
                NixlProducer(f"eric-{instance_id}", f"{public_url}/v1/transfer/nixl/metadata", tc.advertise_host)
            )
    return backends


class TransferHub:
    """Owns the pool for the router. Use from the event loop only. `pool_name` names the shared-memory pool,
    `instance_id` this run of the producer (new at every start), `public_url` where consumers reach its HTTP API."""

    def __init__(self, transfer: TransferConfig, *, pool_name: str, instance_id: str, public_url: str) -> None:
        self._transfer, self._instance_id, self._public_url = transfer, instance_id, public_url
        self._space_freed = asyncio.Event()
        self._handed: OrderedDict[str, str] = OrderedDict()  # acknowledged token -> the child answered for it
        self.pool = EmbeddingPool(
            pool_name, transfer.pool_bytes, transfer.ttl_s, transfer.keep_acked_bytes, on_free=self._space_freed.set
        )
        self.backends = create_backends(transfer, pool_name, instance_id, public_url)
        for backend in self.backends:
            backend.register(self.pool.base_addr, self.pool.nbytes)

    @property
    def instance_id(self) -> str:
        """This Eric's instance id (it changes on restart)."""
        return self._instance_id

    def backend(self, name: str) -> ProducerBackend | None:
        """The producer backend of that name, or None when it is not configured."""
        return next((b for b in self.backends if b.name == name), None)

    async def reserve(self, key: str, nbytes: int, shape: tuple[int, ...], dtype: str) -> PoolEntry:
        """Pool space for one embedding (reserve_all of one)."""
        (entry,) = await self.reserve_all([Want(key, nbytes, shape, dtype)])
        return entry

    async def reserve_all(self, wants: list[Want]) -> list[PoolEntry]:
        """Pool space for every embedding of a request, all or none, waiting up to pool_wait_s for acks or expiry to
        free some. A request that needs more than the whole pool is refused at once (413: it could never fit); one
        that must wait holds nothing meanwhile, so requests cannot starve each other holding parts of the pool."""
        total = sum(span(w.nbytes) for w in wants)
        if total > self.pool.nbytes:
            raise ApiError(
                413,
                f"the request's embeddings need {total} bytes, more than this Eric's whole pool "
                f"({self.pool.nbytes} bytes, --pool-bytes): send fewer or smaller items at a time",
            )
        deadline = time.monotonic() + self._transfer.pool_wait_s
        while True:
            self._space_freed.clear()  # before trying: a free from now on wakes the wait below
            entries = self._try_reserve(wants)
            if entries is not None:
                return entries
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolFullError(
                    f"embedding pool full ({self.pool.used_bytes} of {self.pool.nbytes} bytes held "
                    f"by {len(self.pool)} unacknowledged entries); retry later"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._space_freed.wait(), remaining)

    def _try_reserve(self, wants: list[Want]) -> list[PoolEntry] | None:
        """Every reservation now, or None with nothing reserved."""
        entries: list[PoolEntry] = []
        try:
            for want in wants:
                entry = self.pool.reserve(want.key, want.nbytes, want.shape, want.dtype)
                if entry is None:
                    self._roll_back(entries)
                    return None
                entries.append(entry)
        except BaseException:  # a key already reserved: what this call reserved goes back too
            self._roll_back(entries)
            raise
        return entries

    def _roll_back(self, entries: list[PoolEntry]) -> None:
        """Free reservations never written (at once: nothing writes there)."""
        for taken in entries:
            self.pool.release(taken.hash, taken.generation)

    def lease_written(self, entries: list[PoolEntry]) -> dict[str, EmbeddingHandle] | None:
        """One lease on each of these written reservations (by hash), or None, with none taken, if one has left its
        hash since (freed: its last lease lapsed)."""
        handles: dict[str, EmbeddingHandle] = {}
        for entry in entries:
            if self.pool.get(entry.hash) is not entry or not entry.ready:
                for handle in handles.values():
                    self.ack(handle.hash, handle.lease)
                return None
            handles[entry.hash] = self.lease(entry.hash)
        return handles

    def refresh(self, handles: Iterable[EmbeddingHandle]) -> str | None:
        """Restart each lease's TTL as its handle is answered (a consumer's time to read and ack counts from then,
        however long the request took); the hash of the first one that had lapsed meanwhile, or None."""
        return next((h.hash for h in handles if not self.pool.refresh(h.hash, h.lease)), None)

    def release(self, entry: PoolEntry) -> None:
        """Free exactly this reservation of the entry (never a newer one of the same hash)."""
        self.pool.release(entry.hash, entry.generation)
        self._space_freed.set()

    def ack(self, key: str, token: str | None, instance_id: str | None = None, retry: bool = False) -> tuple[int, str]:
        """(HTTP status, message) for the acknowledgement of the lease `token` names. A `retry` (the consumer's
        earlier attempt went unanswered) of an ack that already took effect is a 200 "already acknowledged" that
        changes nothing, so the consumer can tell "my first attempt ended it" from "it expired first" (a 404: the
        bytes it read are not proven the producer's). Any other repeat stays a 404: bytes read after the lease
        ended are proven by nothing."""
        if instance_id is not None and instance_id != self.instance_id:
            return 409, f"instance {instance_id} is gone: this Eric restarted (now {self.instance_id})"
        if not self.pool.ack(key, token):
            if retry and self.pool.acked_before(key, token):
                return 200, "already acknowledged"
            return 404, (
                f"no lease with this token on embedding {key} (never encoded here, already acknowledged, "
                "expired, or a wrong token)"
            )
        self._space_freed.set()
        return 200, "ok"

    @property
    def pool_wait_s(self) -> float:
        """How long a reservation waits for pool space before it is refused."""
        return self._transfer.pool_wait_s

    def hand_over(
        self, key: str, token: str | None, instance_id: str | None = None, retry: bool = False
    ) -> tuple[int, str, str | None]:
        """`ack`, with a soft child lease of the same root taken first and answered (None when the lease had ended or
        may add no more children): the consumer proves its read as an ack does, yet may read the entry again (vLLM
        preempted its request and evicted the item). The child ends with its own ack or at the TTL, and yields to
        space (the pool evicts an entry only such leases hold). A retry whose first attempt took effect is answered
        that attempt's child again, while it holds."""
        child = None
        if instance_id is None or instance_id == self.instance_id:
            with contextlib.suppress(LeaseError):
                (child,) = self.pool.add_leases(key, token, 1, soft=True)
        status, message = self.ack(key, token, instance_id, retry)
        if child is not None and token is not None:
            self._handed[token] = child
            while len(self._handed) > MAX_ENDED_LEASES:
                self._handed.popitem(last=False)
        elif status == 200 and token is not None:  # "already acknowledged"
            earlier, entry = self._handed.get(token), self.pool.get(key)
            child = earlier if entry is not None and entry.holds(earlier) else None
        return status, message, child

    def lease(self, key: str) -> EmbeddingHandle:
        """A new lease on a held entry, as the handle its consumer reads and acknowledges with."""
        entry, token = self.pool.lease(key)
        return self.handle(entry, token)

    def handle(self, entry: PoolEntry, token: str) -> EmbeddingHandle:
        """The handle a consumer reads `entry` by under lease `token`: every backend's location and the HTTP URL."""
        url = self._public_url
        locations: dict[str, Any] = {b.name: b.location(entry.offset) for b in self.backends}
        return EmbeddingHandle(
            hash=entry.hash,
            shape=entry.shape,
            dtype=entry.dtype,
            nbytes=entry.nbytes,
            producer=url,
            instance_id=self.instance_id,
            generation=entry.generation,
            http=f"{url}/v1/embeddings/{entry.hash}",
            lease=token,
            **locations,
        )

    async def expiry_loop(self, period_s: float = 1.0) -> None:
        """Every `period_s`, free the entries whose leases expired, and wake reservations waiting for space."""
        while True:
            await asyncio.sleep(period_s)
            if self.pool.expire():
                self._space_freed.set()

    def stats(self) -> ProducerInfo:
        """What GET /v1/transfer answers: the pool's statistics and this producer's own locations of offset 0
        (consumers check handles against them)."""
        locations: dict[str, Any] = {b.name: b.location(0) for b in self.backends}
        return ProducerInfo(
            instance_id=self.instance_id,
            pool_name=self.pool.name,
            pool_bytes=self.pool.nbytes,
            used_bytes=self.pool.used_bytes,
            entries=len(self.pool),
            cached_bytes=self.pool.cached_bytes,
            backends=["http", *(b.name for b in self.backends)],
            **locations,
        )

    def close(self) -> None:
        """Close every backend (errors are logged) and then the pool."""
        for backend in self.backends:
            try:
                backend.close()
            except Exception:
                logger.exception("closing transfer backend %s", backend.name)
        self.pool.close()
