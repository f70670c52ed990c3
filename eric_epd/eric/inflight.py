"""The hashes Eric's router is encoding now: the requests waiting for each, the engine request encoding it, and the
bridge lease that keeps a written one until those requests have leased it (see docs/glossary.md)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from eric_epd.common.errors import ApiError
from eric_epd.runtime.engine.client import EngineClient, EngineRequest
from eric_epd.transfer.producer import TransferHub
from eric_epd.wire.handles import EmbeddingHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Flight:
    """One engine request and each hash's item index in it (for aborting single items)."""

    request: EngineRequest
    index: dict[str, int]


class InFlight:
    """The cancellation bookkeeping of EncodeService: `futures` wakes the requests waiting for a hash, `wanted`
    counts the live requests that want it (its owner included), `flights` names the engine request encoding it until
    it settles, and `bridges` holds the lease on a written one until no live request waits for it."""

    def __init__(self, hub: TransferHub, client: EngineClient) -> None:
        self._hub = hub
        self._client = client
        self.futures: dict[str, asyncio.Future[None]] = {}  # in-flight hash -> set once it is settled
        self.wanted: Counter[str] = Counter()  # in-flight hash -> live requests waiting for it (owner included)
        self.flights: dict[str, Flight] = {}  # hash -> the engine request encoding it, until settled
        self.bridges: dict[str, EmbeddingHandle] = {}  # written hash -> lease held until its waiters lease it

    def want(self, keys: Iterable[str]) -> None:
        """One more live request wants each of these in-flight hashes."""
        for key in keys:
            self.wanted[key] += 1

    def unwant(self, keys: Iterable[str]) -> None:
        """A request no longer waits for these hashes (it leased them, failed or left). A hash nobody wants any
        more gives back its bridge lease if it is written, or is aborted in the engine if it is still queued."""
        aborts: dict[str, tuple[Flight, list[int]]] = {}
        for key in keys:
            self.wanted[key] -= 1
            if self.wanted[key] > 0:
                continue
            del self.wanted[key]
            self.drop_bridge(key)
            flight = self.flights.get(key)
            if flight is not None:
                aborts.setdefault(flight.request.request_id, (flight, []))[1].append(flight.index[key])
        for flight, indices in aborts.values():
            logger.info("aborting %d unwanted items of engine request %s", len(indices), flight.request.request_id)
            self._client.abort(flight.request, indices)

    def drop_bridge(self, key: str) -> None:
        """Give back the bridge lease on `key`, if one is held."""
        handle = self.bridges.pop(key, None)
        if handle is not None:
            self.give_back([handle])

    def give_back(self, handles: Iterable[EmbeddingHandle]) -> None:
        """End exactly the leases this router took (for a request that failed or whose client left, or a bridge):
        the entry is freed, or kept as the --keep-acked-bytes content cache allows, once no lease is left."""
        for handle in handles:
            status, message = self._hub.ack(handle.hash, handle.lease)
            if status != 200:
                logger.debug("giving back the lease on %s: %s", handle.hash[:12], message)

    def finish(self, keys: Collection[str], error: BaseException | None) -> None:
        """Wake requests waiting on these hashes (they re-check the pool, so an error needs no propagation)."""
        for key in keys:
            future = self.futures.pop(key, None)
            if future is not None and not future.done():
                future.set_result(None)
        quiet = ApiError | asyncio.CancelledError  # the engine's and the pool's errors included; a client that left
        if error is not None and not isinstance(error, quiet):
            logger.warning("encode of %d items failed: %r", len(keys), error)
