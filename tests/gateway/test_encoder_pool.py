"""The gateway's encoder pool against small in-process HTTP servers standing in for an Eric's card and health routes:
a card that could not be read is read again, leases of a removed Eric can still be given back, one member httpx
cannot even parse does not end the health checks of the others, and its bookkeeping stays bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import aiohttp
import httpx
import pytest
from aiohttp import web
from epd_gateway import cards
from epd_gateway.encode_call import new_encoder_session
from epd_gateway.encoders import EncoderPool
from epd_gateway.loadcheck import Completions
from epd_gateway.members import CARD_RETRY_S, CARD_TIMEOUT_S
from epd_gateway.metrics import GatewayMetrics

from tests.support.aiohttp_standin import serving

CARD = {"object": "list", "data": [{"id": "m", "modalities": ["image", "video"], "placement": "media"}]}


@asynccontextmanager
async def _eric_standin(card_after: int, card_delay_s: float = 0.0) -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server answering /health, and /v1/models with 503 for its first `card_after` calls (an Eric still
    starting), then with CARD, each after `card_delay_s`; yields its URL and the paths asked."""
    asked: list[str] = []

    async def models(_: web.Request) -> web.Response:
        asked.append("/v1/models")
        await asyncio.sleep(card_delay_s)
        if asked.count("/v1/models") <= card_after:
            return web.json_response({"error": "starting"}, status=503)
        return web.json_response(CARD)

    app = web.Application()
    app.router.add_get("/v1/models", models)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/health", health)
    async with serving(app) as url:
        yield url, asked


def _pool(*urls: str, encode_session: aiohttp.ClientSession | None = None) -> EncoderPool:
    return EncoderPool(urls, httpx.AsyncClient(), encode_session, GatewayMetrics(), 2, 5.0)


def test_a_card_that_could_not_be_read_is_read_again_later_and_on_readmission(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        async with _eric_standin(card_after=1) as (url, asked):
            pool = _pool(url)
            assert await pool.serve({"audio"}) and await pool.places_media()  # unread: may serve all, place media
            assert await pool.serve({"audio"}) and asked == ["/v1/models"]  # not read again at once ...
            later = time.monotonic() + CARD_RETRY_S + 1  # the pool's clock only: the event loop keeps the real one
            monkeypatch.setattr(cards, "time", SimpleNamespace(monotonic=lambda: later))
            assert not await pool.serve({"audio"}) and await pool.places_media()  # ... but once the delay passed
            assert asked == ["/v1/models"] * 2
            member = pool.healthy()[0]
            member.healthy = False  # ejected, then readmitted by a probe: it may have restarted
            await pool._probe(member)  # the probe that readmits it reads its card again, off the requests' path
            assert member.healthy and member.modalities == {"image", "video"} and asked == ["/v1/models"] * 3
            assert await pool.places_media() and asked == ["/v1/models"] * 3

    asyncio.run(run())


def test_a_card_is_read_once_for_every_request_waiting_and_a_hung_read_is_bounded() -> None:
    """Twenty requests needing the card of an Eric that answers slowly cause one read; one that hangs past
    CARD_TIMEOUT_S leaves it unread (taken to serve all) within that bound, and a request that leaves does not end
    the read the others wait for."""

    async def run() -> None:
        async with _eric_standin(card_after=0, card_delay_s=0.5) as (url, asked):
            pool = _pool(url)
            assert all(await asyncio.gather(*(pool.places_media() for _ in range(20))))
            assert asked == ["/v1/models"]
        async with _eric_standin(card_after=0, card_delay_s=CARD_TIMEOUT_S + 2) as (url, asked):
            pool = _pool(url)
            leaver = asyncio.ensure_future(pool.places_media())
            await asyncio.sleep(0.1)
            leaver.cancel()
            started = time.monotonic()
            assert await pool.places_media() and await pool.serve({"audio"})  # unread: media inlined, all served
            assert time.monotonic() - started < CARD_TIMEOUT_S + 1 and asked == ["/v1/models"]

    asyncio.run(run())


def test_leases_of_an_eric_removed_any_way_can_still_be_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool()
    for url in ("http://10.0.0.1:1", "http://10.0.0.2:1"):
        pool.register(url)
    assert pool.deregister("http://10.0.0.1:1") and pool.knows("http://10.0.0.1:1")  # by the admin
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 3600)
    assert pool.drop_silent() == ["http://10.0.0.2:1"] and pool.knows("http://10.0.0.2:1")  # for its silence
    assert pool.urls == [] and not pool.knows("http://10.0.0.3:1")


def test_a_member_httpx_cannot_parse_does_not_end_the_health_checks() -> None:
    async def run() -> None:
        async with _eric_standin(card_after=0) as (url, _):
            pool = _pool("http://10.0.0.5:8000/\x7f", url)
            good = next(m for m in pool._members.values() if m.url == url)
            good.healthy = False
            loop = asyncio.create_task(pool.health_loop(0.01))
            for _ in range(500):
                if good.healthy:
                    break
                await asyncio.sleep(0.01)
            assert not loop.done(), loop.exception() if loop.done() else None
            assert good.healthy  # readmitted by a round that also probed the unparsable member
            loop.cancel()

    asyncio.run(run())


def test_completions_stay_within_their_window_when_nobody_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    done = Completions(window_s=10.0)
    for _ in range(10_000):
        clock[0] += 1.0
        done.add(3)
    assert len(done._answered) <= 11
    assert done.per_s() == pytest.approx(3.0, rel=0.11)


@asynccontextmanager
async def _busy_eric(retry_after: str) -> AsyncIterator[str]:
    """An HTTP server answering /v1/encode 503 with this Retry-After, as a draining (or full) Eric does."""

    async def encode(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "draining"}}, status=503, headers={"Retry-After": retry_after})

    app = web.Application()
    app.router.add_post("/v1/encode", encode)
    async with serving(app) as url:
        yield url


def test_an_eric_answering_503_with_retry_after_rests_and_is_not_ejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 503 with Retry-After (busy, or draining) is no failure: the Eric is not ejected however often it says so,
    and new items pass it over while another is awake, for as long as it asked (at most MAX_REST_S), then take it
    again; alone, it is still tried."""
    from epd_gateway.content import MediaRef
    from epd_gateway.members import MAX_REST_S, rest_s

    assert (rest_s("2"), rest_s("3600"), rest_s("Wed, 21 Oct 2026 07:28:00 GMT")) == (2.0, MAX_REST_S, 1.0)

    async def run() -> None:
        async with _busy_eric("2") as busy, new_encoder_session({}) as session:
            pool = _pool(busy, "http://10.0.0.9:1", encode_session=session)
            member = pool._members[busy]
            ref = MediaRef(0, 0, "image", "data:image/png;base64,AA==")
            for _ in range(5):  # past --eject-after-failures (2 here)
                assert await pool._call(busy, [ref]) is None
            assert member.healthy and member.failures == 0
            start = time.monotonic()
            assert [m.url for m in pool.preference(b"k", set())] == ["http://10.0.0.9:1"]
            assert [m.url for m in pool.preference(b"k", {"http://10.0.0.9:1"})] == [busy]  # alone: tried
            monkeypatch.setattr(time, "monotonic", lambda: start + 2.1)
            assert busy in [m.url for m in pool.preference(b"k", set())]  # its rest is over

    asyncio.run(run())
