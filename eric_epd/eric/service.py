"""Encode orchestration in the router: fetch, preprocess, dedupe by content hash, reserve pool space, submit, lease."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from eric_epd.common.all_or_none import all_or_none
from eric_epd.common.errors import ApiError
from eric_epd.eric.admission import Admission
from eric_epd.eric.alias import RawAlias, alias_keys, data_url_keys
from eric_epd.eric.answers import ItemAnswer, OutputSpec, RequestClock, Staging, soundtrack_answer
from eric_epd.eric.inflight import Flight, InFlight
from eric_epd.eric.metrics import EricMetrics
from eric_epd.eric.processor import PreparedItem, Processor
from eric_epd.eric.workload import work_item
from eric_epd.media.fetch import MediaFetcher
from eric_epd.media.url_policy import MediaError
from eric_epd.runtime.engine.client import EngineClient, EngineUnavailableError
from eric_epd.runtime.work import ItemResult
from eric_epd.transfer.global_cache import GlobalCache
from eric_epd.transfer.pool import Hold, PoolEntry
from eric_epd.transfer.producer import TransferHub, Want
from eric_epd.wire.eric import EncodeItem
from eric_epd.wire.handles import EmbeddingHandle


class EncodeService:
    """Serves /v1/encode: items fetched, preprocessed, deduplicated by content hash, encoded or found cached, leased."""

    def __init__(
        self,
        fetcher: MediaFetcher,
        processor: Processor,
        client: EngineClient,
        hub: TransferHub,
        metrics: EricMetrics,
        output: OutputSpec,
        global_cache: GlobalCache | None = None,
        max_items: int = 512,
        alias: RawAlias | None = None,
    ) -> None:
        self._fetcher = fetcher
        self.alias = alias  # raw bytes -> content hash: a resent item still in the pool is not decoded again
        self.admission = Admission(max_items)
        self._global = global_cache
        self._sharing: set[asyncio.Task[None]] = set()
        self._processor = processor
        self._client = client
        self.hub = hub
        self._metrics = metrics
        self._output = output
        self._inflight = InFlight(hub, client)  # cancellation bookkeeping: see InFlight.unwant
        self._settling: set[asyncio.Task[tuple[ApiError | None, float]]] = set()

    async def encode(
        self,
        items: list[EncodeItem],
        clock: RequestClock | None = None,
        sglang: bool = False,
        staging: Staging | None = None,
    ) -> list[ItemAnswer]:
        """Handles for `items`, in order; `clock` collects the forward time of the batches they rode in;
        `sglang=True`: audio as SGLang reads it (Processor.prepare_many); `staging`: more pool space the
        caller needs with the items, reserved all or none with them. Refused at once (nothing fetched) when the
        items accepted and not answered would pass `max_items`: 503 to retry, 413 if it never could fit."""
        self.admission.admit(len(items))
        try:
            start = time.perf_counter()
            prepared, leased = await self._prepare(items, sglang, staging)
            handles = await self._embed(  # from here on, _embed gives back the alias hits' leases on failure
                [p for pair in prepared for p in pair if p is not None], clock or RequestClock(), staging, leased
            )
            self._metrics.observe_request(time.perf_counter() - start)
        except BaseException:
            if staging is not None:
                for entry in staging.entries or ():
                    self.hub.release(entry)
                staging.entries = None
            raise
        finally:
            self.admission.done(len(items))
        return [
            ItemAnswer(r, p, handles[p.hash], soundtrack_answer(r, track, handles))
            for r, (p, track) in zip(items, prepared)
        ]

    def stop_admitting(self) -> None:
        """Draining: every later encode is refused (503, Retry-After: the caller goes to another Eric); the leases
        already handed out are still read and acknowledged."""
        self.admission.draining = True

    @property
    def idle(self) -> bool:
        """No request is being fetched, prepared or encoded."""
        return self.admission.admitted == 0

    def room(self) -> str | None:
        """Why this Eric would refuse a new item now (draining, or its admission full), or None: its readiness."""
        return self.admission.room()

    async def _prepare(
        self, items: list[EncodeItem], sglang: bool = False, staging: Staging | None = None
    ) -> tuple[list[tuple[PreparedItem, PreparedItem | None]], dict[str, EmbeddingHandle]]:
        """Every item fetched (concurrently), then decoded, preprocessed and hashed, each with its soundtrack where
        asked (an audio item decoded from the same bytes), and `staging`'s wants; the first failure is a 4xx naming
        its item. An item the alias knows whose embedding is in the pool is leased at once instead (one lease per
        hash, returned beside the items: the lease keeps it there); on failure those leases are given back."""
        leased: dict[str, EmbeddingHandle] = {}
        try:
            alias = self.alias
            given = [None] * len(items) if alias is None else await data_url_keys(alias, items, sglang)
            early = [self._alias_hit(key, leased) for key in given]  # a resent data: URL: not even decoded
            # a failed fetch ends its siblings before the request's admission is given back
            fetched = await all_or_none(*(self._fetch(i, item, early[i]) for i, item in enumerate(items)))
            work = [(item.modality, data) for item, (data, _) in zip(items, fetched)]
            tracks = [n for n, item in enumerate(items) if item.use_audio_in_video]
            jobs = work + [("audio", work[n][1]) for n in tracks]
            keys = [None] * len(jobs) if alias is None else await alias_keys(alias, jobs, len(items), sglang, given)
            found = [*early, *[None] * len(tracks)]
            results: list[PreparedItem | MediaError | None] = [
                got if got is not None else self._alias_hit(key, leased) for got, key in zip(found, keys)
            ]
            if todo := [i for i, got in enumerate(results) if got is None]:
                for i, got in zip(todo, await self._processor.prepare_many([jobs[i] for i in todo], sglang)):
                    results[i] = got
                    if self.alias is not None and isinstance(got, PreparedItem):
                        self.alias.remember(keys[i], got)
            soundtrack = dict(zip(tracks, results[len(items) :]))
            prepared: list[tuple[PreparedItem, PreparedItem | None]] = []
            for index, (item, (_, seconds), result) in enumerate(zip(items, fetched, results)):
                track = soundtrack.get(index)
                for got, what in ((result, ""), (track, "its soundtrack (use_audio_in_video): ")):
                    if isinstance(got, MediaError):
                        raise ApiError(got.status, f"item {index} ({item.id}): {what}{got.message}") from got
                assert isinstance(result, PreparedItem) and isinstance(track, PreparedItem | None)
                self._metrics.observe_item(seconds, None if result.aliased else result.seconds)
                prepared.append((result, track))
            if staging is not None:
                staging.wants = staging.want([p for p, _ in prepared])
        except BaseException:
            self._inflight.give_back(leased.values())
            raise
        return prepared, leased

    def _alias_hit(self, key: bytes | None, leased: dict[str, EmbeddingHandle]) -> PreparedItem | None:
        """The light item the alias has for `key`, leased at once (the check and the lease are one step of the event
        loop: nothing frees the entry between them), or None: it must be prepared in full."""
        hit = self.alias.find(key, self.hub.pool.written) if self.alias is not None else None
        if hit is not None:
            self._metrics.alias_hits.labels(modality=hit.item.modality).inc()
            if hit.hash not in leased:
                leased[hit.hash] = self.hub.lease(hit.hash)
                self._metrics.items.labels(modality=hit.item.modality, source="cached").inc()
        return hit

    async def _fetch(self, index: int, item: EncodeItem, found: PreparedItem | None) -> tuple[bytes, float | None]:
        if found is not None:  # found by its data: URL's text: nothing to fetch
            return b"", None
        start = time.perf_counter()
        try:
            data = await self._fetcher.fetch(item.url)
        except MediaError as e:
            raise ApiError(e.status, f"item {index} ({item.id}): {e.message}") from e
        return data, time.perf_counter() - start

    async def _embed(
        self,
        prepared: list[PreparedItem],
        clock: RequestClock,
        staging: Staging | None,
        leased: dict[str, EmbeddingHandle],
    ) -> dict[str, EmbeddingHandle]:
        """One lease per distinct hash (`leased`: those taken already, the alias hits'); every hash encoded at most
        once at a time, across requests too; `staging`'s space reserved with the items this request encodes (alone,
        at the end, if it encodes none).

        Cancellation-safe: on any failure or cancellation (the client left) the leases taken are given back, and
        in-flight work that no other live request wants is aborted in the engine."""
        distinct = {p.hash: p for p in prepared}
        handles: dict[str, EmbeddingHandle] = dict(leased)
        waited: list[str] = []  # hashes another request is encoding for us too (counted in InFlight.wanted)
        try:
            for _attempt in range(3):  # an entry may be freed between another request's commit and our lease
                waiting: dict[str, asyncio.Future[None]] = {}
                mine: dict[str, PreparedItem] = {}
                for key, p in distinct.items():
                    if key in handles:
                        continue
                    entry = self.hub.pool.get(key)
                    if entry is not None and entry.ready:
                        handles[key] = self.hub.lease(key)
                        self._metrics.items.labels(modality=p.item.modality, source="cached").inc()
                    elif key in self._inflight.futures:
                        waiting[key] = self._inflight.futures[key]
                    else:
                        mine[key] = p
                self._inflight.want(waiting)
                self._inflight.unwant(waited)  # only now: the pass above leased what they were held for
                waited = list(waiting)
                if mine:
                    handles.update(await self._submit(mine, clock, staging))
                if not waiting:
                    if staging is not None and staging.entries is None:
                        staging.entries = await self.hub.reserve_all(staging.wants)
                    if (lapsed := self.hub.refresh(handles.values())) is not None:  # the TTL counts from the answer
                        raise ApiError(503, f"the lease on {lapsed[:12]} lapsed before its answer", retry_after=1)
                    return handles
                await self._wait_for_others(waiting)
            raise ApiError(503, "embeddings were freed while this request waited for them; retry", retry_after=1.0)
        except BaseException:
            self._inflight.unwant(waited)
            self._inflight.give_back(handles.values())
            raise

    async def _wait_for_others(self, waiting: dict[str, asyncio.Future[None]]) -> None:
        """Wait for hashes other requests are encoding: at most as long as their owner may (a wait for pool space,
        its store reads and a second wait for space after they time out, then the engine's request timeout), then
        504."""
        timeout = self._client.request_timeout_s + 2 * self.hub.pool_wait_s
        timeout += self._global.read_wait_s if self._global is not None else 0.0
        try:
            await asyncio.wait_for(asyncio.gather(*(asyncio.shield(f) for f in waiting.values())), timeout)
        except TimeoutError as e:
            raise ApiError(504, f"items another request is encoding were not ready after {timeout}s") from e

    async def _submit(
        self, mine: dict[str, PreparedItem], clock: RequestClock, staging: Staging | None = None
    ) -> dict[str, EmbeddingHandle]:
        """Encode hashes nobody is encoding yet as one engine request; one lease on each for this request."""
        loop = asyncio.get_running_loop()
        for key in mine:
            self._inflight.futures[key] = loop.create_future()
        self._inflight.want(mine)
        try:
            start = time.perf_counter()
            entries = await self._reserve(mine, staging)
            self._metrics.stages.observe("pool_reserve", time.perf_counter() - start)
            stored, entries = await self._from_global(mine, entries)
            encode = {k: p for k, p in mine.items() if k not in stored}
            if encode:
                await self._run(encode, [e for e in entries if e.hash in encode], clock)
            handles = self.hub.lease_written(entries)
            if handles is None:  # freed meanwhile (its bridge lease lapsed: a TTL below the request's time)
                raise ApiError(503, "an embedding was freed before it was answered; retry", retry_after=1.0)
        except BaseException:
            self._inflight.unwant(mine)  # aborts in the engine whatever no other request waits for
            raise
        for entry in entries:
            source = "global" if entry.hash in stored else "encoded"
            self._metrics.items.labels(modality=mine[entry.hash].item.modality, source=source).inc()
            if source == "encoded" and self._global is not None:
                self._share(entry)
        self._inflight.unwant(mine)
        return handles

    async def _from_global(
        self, mine: dict[str, PreparedItem], entries: list[PoolEntry]
    ) -> tuple[set[str], list[PoolEntry]]:
        """Items another Eric encoded, read from the global cache into their reserved regions and committed (as an
        encode would have); the others are left to encode, in the entries returned with them.

        The reads run in threads nothing can stop. If this request is cancelled (its client left) or the reads
        outlast the store's read_wait_s, their entries leave their hashes, and the reads' holds keep the regions
        until the reads return. Cancelled: the hashes are resolved at once, so requests waiting for them encode (or
        read) them anew. Timed out: this request reserves fresh regions and encodes every item itself."""
        if self._global is None:
            return set(), entries
        cache = self._global
        holds = [self.hub.pool.hold(e, "store-read") for e in entries]  # the reads write there until they return
        reads = asyncio.ensure_future(
            asyncio.gather(*(cache.read_into(e.hash, self.hub.pool.view(e)) for e in entries))
        )
        reads.add_done_callback(lambda _: [h.end() for h in holds])
        try:
            found = await asyncio.wait_for(asyncio.shield(reads), cache.read_wait_s)
        except BaseException as e:
            for entry in entries:
                self.hub.release(entry)  # off their hashes now; the regions return when the reads do
            if not isinstance(e, TimeoutError):
                self._inflight.finish(mine, e)
                raise
            cache.timed_out(len(entries))
            return set(), await self._reserve(mine)
        stored = {e.hash for e, ok in zip(entries, found) if ok}
        for key in stored:
            self.hub.pool.commit(key)
            self._inflight.bridges[key] = self.hub.lease(key)  # as _settle: waiters lease it before it can go
        self._inflight.finish({k: mine[k] for k in stored}, None)
        return stored, entries

    def _share(self, entry: PoolEntry) -> None:
        """Put a freshly encoded entry into the global cache in the background, holding a lease on it (so it stays
        under its hash) and the region's fence (so nothing reuses the region) until the store's copy has returned."""
        assert self._global is not None
        if not self._global.accepting_puts:  # the store is down or slow: this one stays local (nothing is held)
            return
        handle = self.hub.lease(entry.hash)
        hold = self.hub.pool.hold(entry, "store-put")

        def done(task: asyncio.Task[None]) -> None:
            self._sharing.discard(task)
            hold.end()
            self._inflight.give_back([handle])

        task = asyncio.create_task(self._global.write(entry.hash, self.hub.pool.view(entry)))
        self._sharing.add(task)
        task.add_done_callback(done)

    async def _reserve(self, mine: dict[str, PreparedItem], staging: Staging | None = None) -> list[PoolEntry]:
        """Pool space for every item and for `staging` (unless it has its space), all or none; on failure (or
        cancellation) the waiters are woken: nothing was sent to the engine yet, so nothing can write there."""
        wants = [
            Want(
                key,
                self._output.nbytes(p.item.num_tokens, p.item.modality),
                (p.item.num_tokens, self._output.width(p.item.modality)),
                self._output.dtype,
            )
            for key, p in mine.items()
        ]
        extra = staging.wants if staging is not None and staging.entries is None else []
        try:
            entries = await self.hub.reserve_all(wants + extra)
        except BaseException as e:
            self._inflight.finish(mine, e)
            raise
        if staging is not None and staging.entries is None:
            staging.entries = entries[len(wants) :]
        return entries[: len(wants)]

    async def _run(self, mine: dict[str, PreparedItem], entries: list[PoolEntry], clock: RequestClock) -> None:
        """Submit to the engine and wait for the settled result. The settling runs on its own task: a timeout or a
        cancellation of this request never frees pool space the engine may still write."""
        try:
            items = [work_item(p.hash, p.item, e.offset, e.nbytes) for p, e in zip(mine.values(), entries)]
            request = self._client.submit(items, [np.asarray(p.item.pixel_values) for p in mine.values()])
        except BaseException as e:  # never sent: free the space and answer whoever waits for these hashes
            for entry in entries:
                self.hub.release(entry)
            self._inflight.finish(mine, e)
            raise
        holds = [self.hub.pool.hold(e, "engine") for e in entries]  # the workers write there until the answer
        flight = Flight(request, {key: i for i, key in enumerate(mine)})
        self._inflight.flights.update(dict.fromkeys(mine, flight))
        self._metrics.inflight_items.inc(len(items))
        settling = asyncio.create_task(self._settle(flight, mine, entries, holds))
        self._settling.add(settling)
        settling.add_done_callback(self._settling.discard)
        timeout = self._client.request_timeout_s
        try:
            error, compute = await asyncio.wait_for(asyncio.shield(settling), timeout)
        except TimeoutError as e:
            raise ApiError(504, f"encode timed out after {timeout}s") from e
        clock.compute_seconds += compute
        if error is not None:
            raise error

    async def _settle(
        self, flight: Flight, mine: dict[str, PreparedItem], entries: list[PoolEntry], holds: list[Hold]
    ) -> tuple[ApiError | None, float]:
        """After the engine's final answer (or its death): commit what was written, free the rest, wake waiters.
        Each written entry keeps one bridge lease until no live request waits for it any more. Returns the error,
        if any, and the forward time of the batches the items rode in."""
        finished: dict[str, ItemResult] = {}
        error: ApiError | None = None
        compute = 0.0
        try:
            msg, _ = await flight.request.result
            compute = self._metrics.observe_result(msg)
            finished = {r.key: r for r in msg.items}
            error = ApiError(msg.status, msg.error) if msg.error is not None else None
        except EngineUnavailableError as e:
            error = e  # raised only once the engine and its workers are proven gone
        finally:
            self._metrics.inflight_items.dec(len(entries))
            for hold in holds:
                hold.end()
        for entry in entries:
            self._inflight.flights.pop(entry.hash, None)
            result = finished.get(entry.hash)
            if result is not None and tuple(result.shape) == entry.shape and result.dtype == entry.dtype:
                self.hub.pool.commit(entry.hash)
                self._inflight.bridges[entry.hash] = self.hub.lease(entry.hash)
                continue
            if result is not None:
                error = ApiError(
                    500, f"encoder produced {result.shape} {result.dtype}, expected {entry.shape} {entry.dtype}"
                )
            error = error or ApiError(500, f"the engine's answer lacks item {entry.hash}")
            self.hub.release(entry)  # the engine has answered: nothing writes there any more
        self._inflight.finish(mine, error)
        for entry in entries:
            if self._inflight.wanted[entry.hash] <= 0:
                self._inflight.drop_bridge(entry.hash)
        return error, compute
