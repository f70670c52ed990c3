"""An Eric's answer must answer the items asked, one each, in order: one that drops, adds or reorders items (a broken
or foreign Eric) fails over like a 5xx instead of putting one item's embedding in another's place, and the leases it
handed out are given back. Against an in-process stand-in Eric."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import msgspec
from aiohttp import web
from epd_gateway.content import MediaRef
from epd_gateway.encode_call import new_encoder_session
from epd_gateway.encoders import EncoderPool
from epd_gateway.metrics import GatewayMetrics

from eric_epd.wire.eric import EncodeAnswer, EncodedItem
from tests.support.aiohttp_standin import serving
from tests.support.encoded import encoded

REFS = [MediaRef(0, 1, "image", "data:image/png;base64,AA=="), MediaRef(1, 0, "image", "data:image/png;base64,AB==")]


@asynccontextmanager
async def _eric_standin(answer: Callable[[str], list[EncodedItem]]) -> AsyncIterator[tuple[str, list[str]]]:
    """Answers /v1/encode with answer(its own URL)'s items and records the hashes acknowledged."""
    acked: list[str] = []

    async def encode(request: web.Request) -> web.Response:
        items = answer(f"http://{request.host}")
        return web.Response(body=msgspec.json.encode(EncodeAnswer("m", items)), content_type="application/json")

    async def ack(request: web.Request) -> web.Response:
        acked.append(request.match_info["content_hash"])
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/encode", encode)
    app.router.add_post("/v1/embeddings/{content_hash}/ack", ack)
    async with serving(app) as url:
        yield url, acked


def _item(key: str, index: int, producer: str) -> EncodedItem:
    ref = REFS[index]
    return msgspec.structs.replace(encoded(key, producer=producer), id=f"messages[{ref.message}].content[{ref.part}]")


def _call(answer: Callable[[str], list[EncodedItem]]) -> tuple[list[EncodedItem] | None, list[str], str]:
    async def run() -> tuple[list[EncodedItem] | None, list[str], str]:
        async with _eric_standin(answer) as (url, acked), new_encoder_session({}) as session:
            pool = EncoderPool((url,), httpx.AsyncClient(), session, GatewayMetrics(), 2, 5.0)
            return await pool._call(url, REFS), acked, url

    return asyncio.run(run())


def test_an_answer_of_the_items_asked_in_order_is_taken() -> None:
    items, acked, _ = _call(lambda url: [_item("a", 0, url), _item("b", 1, url)])
    assert items is not None and [i.hash[0] for i in items] == ["a", "b"] and acked == []  # the control


def test_an_answer_reordered_short_or_long_is_refused_and_its_leases_given_back() -> None:
    for answer, keys in (
        (lambda url: [_item("b", 1, url), _item("a", 0, url)], "ba"),  # swapped: each embedding in the other's place
        (lambda url: [_item("a", 0, url)], "a"),  # one short
        (lambda url: [_item("a", 0, url), _item("b", 1, url), _item("c", 1, url)], "abc"),  # one too many
    ):
        items, acked, _ = _call(answer)
        assert items is None  # fails over like a 5xx
        assert sorted(acked) == sorted(k * 64 for k in keys)  # nobody reads those: their leases go back
