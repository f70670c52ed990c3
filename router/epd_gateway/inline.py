"""Media for the engines' own path: the gateway fetches each remote item itself (the one URL policy that checks the
address at connect time and every redirect) and hands vLLM or SGLang a ``data:`` URL, so no engine fetches a URL."""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
from typing import Any

from epd_gateway.content import MediaRef, check_medium
from eric_epd.common.all_or_none import all_or_none
from eric_epd.common.errors import ApiError
from eric_epd.media.engine_probe import bytes_reader
from eric_epd.media.fetch import ByteBudget, MediaFetcher, SharedBytes
from eric_epd.media.limits import MediaLimits
from eric_epd.media.resolver import MAX_HOSTS_PER_REQUEST
from eric_epd.media.url_policy import Lookup, MediaError, UrlPolicy, url_scheme

logger = logging.getLogger(__name__)

FETCHED_SCHEMES = frozenset({"http", "https", "file"})
"""What an engine would have to fetch (or read) itself; data: URLs already carry their bytes."""


async def check_hosts(resolve: Lookup, hosts: set[tuple[str, int]], timeout_s: float) -> None:
    """Every (host, port) resolved at once (`resolve`: the addresses the policy allows, else MediaError) and checked,
    all within `timeout_s`: more than MAX_HOSTS_PER_REQUEST hosts, a refused or unresolvable host are a 400, hosts
    still unresolved at the deadline a 408 naming them (as a fetch timeout is)."""
    if len({host for host, _ in hosts}) > MAX_HOSTS_PER_REQUEST:
        raise ApiError(
            400,
            f"the request's media name {len({h for h, _ in hosts})} hosts, over the limit of {MAX_HOSTS_PER_REQUEST}",
            param="messages",
        )
    tasks = {asyncio.ensure_future(resolve(host, port)): host for host, port in sorted(hosts)}
    if not tasks:
        return
    try:
        done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a blackholed lookup stops holding the request (its executor thread ends on its own)
    failures = [e for e in (task.exception() for task in tasks if task in done) if e is not None]  # host order
    for e in failures:
        if isinstance(e, MediaError):
            raise ApiError(e.status if e.status < 500 else 400, e.message) from e
    if failures:
        raise failures[0]
    if pending:
        names = ", ".join(tasks[task] for task in tasks if task in pending)
        raise ApiError(408, f"timed out resolving media host(s) {names} (limit {timeout_s:g} s)")


class MediaInliner:
    """One per gateway process: a media fetcher (an aiohttp client behind the URL policy), reused across requests."""

    def __init__(
        self, policy: UrlPolicy, limits: MediaLimits, max_request_bytes: int, max_total_bytes: int | None = None
    ) -> None:
        self._fetcher = MediaFetcher(policy, limits)
        self._max_request_bytes = max_request_bytes
        self.held = SharedBytes(
            max_total_bytes or 4 * max_request_bytes,
            "the gateway holds as much inlined media for other requests as it may "
            "(--max-inline-total-bytes); try again shortly",
        )
        """Media bytes inlined for every request in flight (each request's given back when it ends)."""

    def budget(self) -> ByteBudget:
        """A new request's budget: --max-inline-bytes of its own, held among every request's until closed."""
        return ByteBudget(self._max_request_bytes, self._over_budget(), shared=self.held)

    async def aclose(self) -> None:
        """Close the media fetcher's HTTP client."""
        await self._fetcher.aclose()

    async def resolve_host(self, host: str, port: int) -> list[str]:
        """`host`'s addresses as the fetcher would connect to them (its resolver, the URL policy); 400 if refused."""
        return await self._fetcher.resolve_host(host, port)

    async def inline(self, body: dict[str, Any], refs: list[MediaRef], budget: ByteBudget) -> dict[str, Any] | None:
        """A copy of the request whose remote media parts are data: URLs, or None when it has none (the client's
        raw body can then go as it is). A fetch the policy refuses or that fails is the client's 4xx; media over
        the request's budget (--max-inline-bytes, every part counted, a URL named twice twice) a 413; a part whose
        bytes are no medium of its modality an engine may be given a 400 naming it (`content.check_medium`). Each
        distinct URL is fetched once; every byte fetched is held in `budget` (close it when the request ends)."""
        remote = [ref for ref in refs if url_scheme(ref.url) in FETCHED_SCHEMES]
        if not remote:
            return None
        firsts: dict[str, MediaRef] = {}  # each URL's first part, which its errors name
        for ref in remote:
            firsts.setdefault(ref.url, ref)
        fetched = dict(zip(firsts, await self._fetch_all(list(firsts.values()), budget), strict=True))
        total = sum(len(fetched[ref.url]) for ref in remote)
        if total > self._max_request_bytes:
            raise ApiError(413, f"{self._over_budget()} ({len(remote)} parts, {total} bytes)", param="messages")
        for ref in remote:  # each part as its own modality (one URL may stand in parts of two)
            check_medium(bytes_reader(fetched[ref.url]), ref.modality, f"messages[{ref.message}].content[{ref.part}]")
        inlined = {
            url: "data:application/octet-stream;base64," + base64.b64encode(data).decode()
            for url, data in fetched.items()
        }
        out = dict(body)
        out["messages"] = copy.deepcopy(body["messages"])
        for ref in remote:
            part = out["messages"][ref.message]["content"][ref.part]
            kind = ref.part_type  # an image_url, video_url or audio_url part (input_audio parts carry their data)
            payload, url = part[kind], inlined[ref.url]
            part[kind] = {**payload, "url": url} if isinstance(payload, dict) else {"url": url}
        return out

    def _over_budget(self) -> str:
        return (
            f"the media this request names come to over {self._max_request_bytes} bytes, the most the gateway "
            "inlines for one request (--max-inline-bytes)"
        )

    async def _fetch_all(self, refs: list[MediaRef], budget: ByteBudget) -> list[bytes]:
        """Every ref's bytes, fetched at once under one budget; the first failure stops the others."""
        return await all_or_none(*(self._fetch(ref, budget) for ref in refs))

    async def _fetch(self, ref: MediaRef, budget: ByteBudget) -> bytes:
        try:
            return await self._fetcher.fetch(ref.url, budget)
        except MediaError as e:
            where = f"messages[{ref.message}].content[{ref.part}]"
            if e.status == 503:  # the gateway's own bound, not this item's fault
                raise ApiError(503, e.message, retry_after=e.retry_after) from e
            raise ApiError(e.status if e.status < 500 else 400, f"{where}: {e.message}") from e


class RawBody:
    """The client's request as the engines' own path sends it, media inlined on first need and then reused (an EPD
    request that falls back does not fetch twice)."""

    def __init__(self, inliner: MediaInliner, body: dict[str, Any], raw: bytes | None, refs: list[MediaRef]) -> None:
        self._inliner = inliner
        self._body = body
        self._raw = raw
        self._refs = refs
        self._inlined: tuple[dict[str, Any], bytes | None] | None = None
        self._budget = inliner.budget()

    @property
    def refs(self) -> list[MediaRef]:
        """The request's media items."""
        return self._refs

    async def get(self) -> tuple[dict[str, Any], bytes | None]:
        """(body, raw bytes to forward or None to re-encode the body)."""
        if self._inlined is None:
            inlined = await self._inliner.inline(self._body, self._refs, self._budget)
            self._inlined = (self._body, self._raw) if inlined is None else (inlined, None)
        return self._inlined

    def close(self) -> None:
        """The request has ended: the media inlined for it no longer count against the gateway's total."""
        self._budget.close()
