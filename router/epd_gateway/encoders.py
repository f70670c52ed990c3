"""The encoder pool: rendezvous (consistent) hashing with a load bound, health checks, eject and readmit."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import msgspec

from epd_gateway.cards import CardReader
from epd_gateway.content import MediaRef, soundtracks
from epd_gateway.encode_call import CLIENT_ERRORS, answer_problem, encode_request, media_rejected, post_encode
from epd_gateway.leases import Leases, release_leases
from epd_gateway.members import WAIT_SLACK_S, EncoderState, expected_wait, rendezvous_weight, rest_s
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.scaling import recommended_encoders
from eric_epd.wire.eric import MEDIA, EncodedItem, decode_answer
from eric_epd.wire.load import LoadReport

logger = logging.getLogger(__name__)

MAX_HOLDERS = 65536
"""Items whose Eric the gateway remembers (about 100 bytes each)."""
MAX_DEPARTED = 1024
"""Erics that left by name (dns_members.py) whose leases the gateway may still give back."""


class EncodersUnavailableError(Exception):
    """No encoder could encode the items (all down or failing)."""


class EncoderPool:
    """The Erics: items placed by rendezvous hashing with a load bound, health-checked, ejected and readmitted."""

    def __init__(
        self,
        urls: tuple[str, ...],
        client: httpx.AsyncClient,
        encode_session: aiohttp.ClientSession | None,
        metrics: GatewayMetrics,
        eject_after: int,
        timeout_s: float,
        heartbeat_timeout_s: float = 10.0,
        prover: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        """`client` (httpx) probes the Erics, reads their cards and acks; `encode_session` (aiohttp, the hot path)
        carries the encode calls (None: a pool that never encodes). `prover(url)`: whether an Eric found by name
        proved it holds the key (proof.py); None: names are trusted (the Erics have no key to keep)."""
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._prover = prover
        self._holders: OrderedDict[bytes, str] = OrderedDict()  # routing key -> the Eric that last answered it
        self._members = {u: EncoderState(u) for u in urls}
        self._static = frozenset(urls)
        self._departed: OrderedDict[str, None] = OrderedDict()  # removed by name: their leases can still be acked
        self._client = client
        self._encode_session = encode_session
        self._metrics = metrics
        self._eject_after = eject_after
        self._timeout = timeout_s
        self._cards = CardReader(client)
        self._refresh_gauge()

    @property
    def urls(self) -> list[str]:
        """Every member's URL, healthy or not."""
        return list(self._members)

    def status(self) -> dict[str, bool]:
        """Each member's URL and whether it is healthy (what /health and the admin routes list)."""
        return {m.url: m.healthy for m in self._members.values()}

    def healthy(self) -> list[EncoderState]:
        """The members currently healthy."""
        return [m for m in self._members.values() if m.healthy]

    def register(self, url: str) -> None:
        """Admit an Eric (or note its heartbeat: registering again is how a self-registered Eric stays)."""
        url = url.rstrip("/")
        member = self._members.get(url)
        if member is None:
            logger.info("encoder %s joined", url)
            member = self._members[url] = EncoderState(url, heartbeat=time.monotonic())
        elif member.heartbeat is not None:
            member.heartbeat = time.monotonic()
        self._refresh_gauge()

    def admit(self, url: str) -> None:
        """Admit an Eric a name lists (dns_members.py): a member like an --encoder-urls entry, with no heartbeat."""
        url = url.rstrip("/")
        self._departed.pop(url, None)
        member = self._members.get(url)
        if member is not None:
            member.heartbeat = None  # listed by name now: never dropped for silence
            return
        logger.info(
            "encoder %s joined (its name lists it)%s",
            url,
            "" if self._prover is None else ": no key or media until it proves it holds the key",
        )
        trusted = self._prover is None
        self._members[url] = EncoderState(url, healthy=trusted, by_name=True, proven=trusted)
        self._refresh_gauge()

    async def prove_new(self) -> None:
        """Challenge every member found by name that has not proved itself yet, and probe those that did (so a
        new name's members serve before the next health round)."""
        await asyncio.gather(*(self._probe(m) for m in list(self._members.values()) if not m.proven))

    def dismiss(self, url: str) -> None:
        """Remove an Eric its name no longer lists (an --encoder-urls entry stays): no new work goes there, calls in
        flight finish, and leases it gave out can still be given back."""
        url = url.rstrip("/")
        if url in self._static or self._members.pop(url, None) is None:
            return
        logger.info("encoder %s left (its name no longer lists it)", url)
        self._depart(url)
        self._refresh_gauge()

    def _depart(self, url: str) -> None:
        """Remember a removed Eric (bounded): the leases it gave out can still be given back to it."""
        self._departed[url] = None
        while len(self._departed) > MAX_DEPARTED:
            self._departed.popitem(last=False)

    def knows(self, url: str) -> bool:
        """Whether leases may be given back to `url`: a member, listed by hand, or one its name listed."""
        return url in self._members or url in self._static or url in self._departed

    async def vouch(self, url: str) -> bool:
        """Whether an ack may go to `url` with the Erics' key now: an Eric listed by hand or a proven member; one
        whose address may have changed hands since (found by name and ejected, or gone) proves it holds the key
        first, as a probe does (an ack without the key is refused, so that one's lease is left to its TTL)."""
        member = self._members.get(url)
        if url in self._static or (member is not None and member.proven):
            return True
        if member is None and url not in self._departed:
            return False
        return self._prover is None or await self._prover(url)

    def drop_silent(self) -> list[str]:
        """Forget self-registered Erics whose heartbeats stopped; their URLs."""
        cutoff = time.monotonic() - self._heartbeat_timeout_s
        silent = [m.url for m in self._members.values() if m.heartbeat is not None and m.heartbeat < cutoff]
        for url in silent:
            logger.warning("encoder %s dropped: no heartbeat for %.0f s", url, self._heartbeat_timeout_s)
            del self._members[url]
            self._depart(url)
        if silent:
            self._refresh_gauge()
        return silent

    def deregister(self, url: str) -> bool:
        """Remove the Eric at `url` (admin DELETE); whether it was a member."""
        found = self._members.pop(url.rstrip("/"), None) is not None
        if found:
            self._depart(url.rstrip("/"))
        self._refresh_gauge()
        return found

    def _refresh_gauge(self) -> None:
        self._metrics.encoders_healthy.set(len(self.healthy()))

    def preference(self, key: bytes, exclude: set[str]) -> list[EncoderState]:
        """Healthy encoders by rendezvous weight for this key (the same content prefers the same Eric), without those
        resting after a 503 with Retry-After unless all are."""
        members = [m for m in self.healthy() if m.url not in exclude]
        now = time.monotonic()
        awake = [m for m in members if m.resting_until <= now]
        return sorted(awake or members, key=lambda m: rendezvous_weight(key, m.url), reverse=True)

    async def serve(self, modalities: set[str]) -> bool:
        """Whether every healthy encoder encodes all these modalities (a model's encoder may serve images but not
        videos yet); an encoder whose list cannot be read is taken to serve them (its answer will tell)."""
        return all(not m.modalities or modalities <= m.modalities for m in await self.carded())

    async def places_media(self) -> bool:
        """Whether a healthy encoder's items may go to the engine as their media (placement "media", the generic
        path): one says so, or its card could not be read. The gateway then inlines the media before encoding and
        sends the Erics the data: URLs the engine gets, so Eric encodes the very bytes the engine is sent."""
        return any(m.placement == MEDIA or m.modalities is None for m in await self.carded())

    async def carded(self) -> list[EncoderState]:
        """The healthy encoders, each with its /v1/models card read (the health loop reads it on admission; here
        only one not read yet, all at once, one read per Eric however many requests wait for it)."""
        healthy = self.healthy()
        await asyncio.gather(*(self._cards.read_once(m) for m in healthy if self._cards.due(m)))
        return healthy

    def choose(self, key: bytes, exclude: set[str]) -> EncoderState | None:
        """Where to encode the item with this key: the Eric that last answered it (it holds the embedding in its
        pool or content cache); else its rendezvous Eric, unless by the Erics' own load reports another would start
        it more than WAIT_SLACK_S sooner (queued items over recent items/s); in every case an Eric much busier than
        the least loaded (inflight calls from here) is passed over (bounded load)."""
        order = self.preference(key, exclude)
        if not order:
            return None
        least = min(m.inflight for m in order)
        fits = [m for m in order if m.inflight <= 2 * least + 4]
        holder = self._holders.get(key)
        for member in fits:
            if member.url == holder:
                self._holders.move_to_end(key)
                return member
        if all(m.load is not None for m in fits):
            waits = [expected_wait(m) for m in fits]
            if waits[0] > min(waits) + WAIT_SLACK_S:  # the content's own Eric is clearly the slower start
                return fits[waits.index(min(waits))]
        return fits[0]

    def remember(self, key: bytes, url: str) -> None:
        """`url` answered the item with this key: later requests for it go there while it stays (LRU, bounded)."""
        self._holders[key] = url
        self._holders.move_to_end(key)
        while len(self._holders) > MAX_HOLDERS:
            self._holders.popitem(last=False)

    def leases(self) -> Leases:
        """A request's lease scope (leases.py): what its encodes return is held there and given back on leaving it,
        unless handed to the engine; acks go only to Erics this pool knows."""
        return Leases(self._client, self.vouch)

    async def encode(self, refs: list[MediaRef], leases: Leases) -> tuple[list[EncodedItem], int]:
        """Encode every item somewhere; returns (items in ref order, number of encoders used). Every item's lease is
        held in `leases` the moment its Eric answers. If this fails or is cancelled (the client left), the calls
        still running are cancelled (each Eric sees its caller disconnect and drops the work); the leases already
        held are the scope's to give back."""
        results: dict[int, EncodedItem] = {}
        used = await self._encode_into(refs, results, leases)
        return [results[i] for i in range(len(refs))], len(used)

    async def _encode_into(self, refs: list[MediaRef], results: dict[int, EncodedItem], leases: Leases) -> set[str]:
        """Fill `results` (ref index -> item), failing over between encoders; returns the encoders used."""
        tried: dict[int, set[str]] = defaultdict(set)
        pending = list(range(len(refs)))
        used: set[str] = set()
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                member = self.choose(refs[i].routing_key, tried[i])
                if member is None:
                    raise EncodersUnavailableError(
                        f"no healthy encoder left for item {i} (tried {sorted(tried[i]) or 'none'})"
                    )
                groups[member.url].append(i)
            outcomes = await self._call_groups({url: [refs[i] for i in idx] for url, idx in groups.items()}, leases)
            pending = []
            for (url, idx), items in zip(groups.items(), outcomes):
                if items is None:
                    self._metrics.failovers.inc()
                    for i in idx:
                        tried[i].add(url)
                    pending.extend(idx)
                else:
                    used.add(url)
                    results.update(zip(idx, items))
                    for i in idx:
                        self.remember(refs[i].routing_key, url)
        return used

    async def _call_groups(self, groups: dict[str, list[MediaRef]], leases: Leases) -> list[list[EncodedItem] | None]:
        """Each encoder's answer for its group, called concurrently, its items held in `leases` as it answers. If one
        call raises or this is cancelled, the other calls are cancelled too."""

        async def call(url: str, group: list[MediaRef]) -> list[EncodedItem] | None:
            items = await self._call(url, group)
            leases.hold(items or [])
            return items

        calls = [asyncio.create_task(call(url, group)) for url, group in groups.items()]
        try:
            return [await task for task in calls]
        except BaseException:
            for task in calls:
                task.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            raise

    async def _call(self, url: str, refs: list[MediaRef]) -> list[EncodedItem] | None:
        """Items from one encoder, None if the encoder failed (5xx, timeout, unreachable)."""
        member = self._members.get(url) or EncoderState(url)
        member.inflight += 1
        member.inflight_items += len(refs)
        body = encode_request(refs)
        try:
            if self._encode_session is None:
                raise RuntimeError("this encoder pool was made without an encode session")
            resp = await post_encode(self._encode_session, url, body, self._timeout, self._metrics)
        except (TimeoutError, aiohttp.ClientError) as e:
            logger.warning("encoder %s failed: %r", url, e)
            self._record_failure(member)
            return None
        finally:
            member.inflight -= 1
            member.inflight_items -= len(refs)
        if resp.status >= 500:
            logger.warning("encoder %s answered %d: %s", url, resp.status, resp.body[:200])
            if resp.status == 503 and "retry-after" in resp.headers:  # busy or draining is not a failure
                member.resting_until = time.monotonic() + rest_s(resp.headers["retry-after"])
            else:
                self._record_failure(member)
            return None
        if resp.status not in (200, *CLIENT_ERRORS):  # not about the media: a key, a limit, a route
            logger.warning("encoder %s answered %d: %s", url, resp.status, resp.body[:200])
            self._record_failure(member)
            return None
        if resp.status != 200:  # the client's media is bad: no other encoder will do better
            raise media_rejected(resp)
        try:
            items = list(decode_answer(resp.body).items)
        except msgspec.MsgspecError as e:
            logger.warning("encoder %s answered outside the schema: %s", url, e)
            self._record_failure(member)
            return None
        if (problem := answer_problem(items, refs)) is not None:  # its leases go back: nobody reads those items
            logger.warning("encoder %s %s", url, problem)
            handles = [i.handle for i in [*items, *soundtracks(items)]]
            await asyncio.shield(release_leases(self._client, self.vouch, handles))
            self._record_failure(member)
            return None
        member.failures = 0
        member.completed.add(len(refs))
        return items

    def _record_failure(self, member: EncoderState) -> None:
        self._metrics.failures.labels(stage="encode").inc()
        member.failures += 1
        if member.healthy and member.failures >= self._eject_after:
            member.healthy = False
            member.proven = not (member.by_name and self._prover is not None)  # its address may change hands
            logger.warning("ejecting encoder %s after %d failures", member.url, member.failures)
            self._refresh_gauge()

    async def health_loop(self, interval_s: float) -> None:
        """Every `interval_s`: probe each member, drop silent self-registered ones, update the recommended count."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.probe_all()
                self.drop_silent()
                self._metrics.recommended_encoders.set(self.recommended())
            except Exception:  # one bad member or report must not end the health checks of every Eric
                logger.exception("encoder health round failed")

    async def probe_all(self) -> None:
        """One health round: every member probed (those found by name challenged first, until they prove)."""
        await asyncio.gather(*(self._probe(m) for m in list(self._members.values())))

    def recommended(self) -> int:
        """How many Erics the load needs (scaling.py's formula over the healthy Erics' reports)."""
        healthy = self.healthy()
        return recommended_encoders([r for r in (m.believed() for m in healthy) if r is not None], len(healthy))

    def loads(self) -> dict[str, dict[str, Any] | None]:
        """Each Eric's load as the gateway believes it (loadcheck.py); None before its first report."""
        return {
            m.url: msgspec.to_builtins(r) if (r := m.believed()) is not None else None for m in self._members.values()
        }

    async def _load(self, member: EncoderState) -> LoadReport | None:
        """Its load report; None if it does not serve one (an older Eric) or answers nonsense."""
        try:
            resp = await self._client.get(f"{member.url}/v1/load", timeout=2.0)
            return msgspec.json.decode(resp.content, type=LoadReport) if resp.status_code == 200 else None
        except (httpx.HTTPError, msgspec.DecodeError):
            return None

    async def _probe(self, member: EncoderState) -> None:
        if not member.proven:
            if self._prover is None or not await self._prover(member.url):
                return
            logger.info("encoder %s proved it holds the key", member.url)
            member.proven = True
        try:
            ok = (await self._client.get(f"{member.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        member.load = await self._load(member) if ok else None
        if ok and not member.healthy:
            logger.info("readmitting encoder %s", member.url)
            member.healthy, member.failures = True, 0
            member.modalities, member.card_after = None, 0.0  # it may have restarted: read its card again
        if ok and self._cards.due(member):  # off the requests' path: they find it read
            await self._cards.read_once(member)
        elif not ok and member.healthy:
            self._record_failure(member)
        self._refresh_gauge()
