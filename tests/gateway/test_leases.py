"""The one owner of an EPD request's leases (epd_gateway.leases.Leases) against a real HTTP server standing in for an
Eric's ack route: whatever ends the scope (an error, the client leaving, a refused answer) every lease held is acked
once; handed to the engine, none is; given back early, not again; a producer the gateway does not know, never."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from epd_gateway.leases import Leases
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from eric_epd.stack.process import free_port
from eric_epd.wire.eric import EncodedItem
from eric_epd.wire.handles import LEASE_HEADER
from tests.support.encoded import encoded


@pytest.fixture(scope="module")
def eric() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    acks: list[tuple[str, str]] = []

    async def ack(request: Request) -> JSONResponse:
        acks.append((request.path_params["hash"], request.headers[LEASE_HEADER]))
        return JSONResponse({"ok": True})

    port = free_port()
    app = Starlette(routes=[Route("/v1/embeddings/{hash}/ack", ack, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", acks
    server.should_exit = True


def _item(producer: str, n: int) -> EncodedItem:
    return encoded(f"{n:064x}", producer=producer, lease=f"lease-{n}")


def _run(eric: tuple[str, list], body) -> list[tuple[str, str]]:
    url, acks = eric
    acks.clear()

    async def vouch(producer: str) -> bool:  # the pool's Encoders.vouch: the one Eric it knows
        return producer == url

    async def go() -> None:
        async with httpx.AsyncClient() as client:
            await body(Leases(client, vouch), url)

    asyncio.run(go())
    return sorted(lease for _, lease in acks)


def test_an_error_gives_every_lease_back_once(eric) -> None:
    async def body(leases: Leases, url: str) -> None:
        with pytest.raises(RuntimeError):
            async with leases:
                leases.hold([_item(url, 1), _item(url, 2)])
                leases.hold([_item(url, 2)])  # the same lease twice is held once
                raise RuntimeError("the engine call failed")

    assert _run(eric, body) == ["lease-1", "lease-2"]


def test_a_client_that_leaves_still_gives_them_back(eric) -> None:
    async def body(leases: Leases, url: str) -> None:
        async def request() -> None:
            async with leases:
                leases.hold([_item(url, 3)])
                await asyncio.Event().wait()  # waiting on the engine when the client leaves

        task = asyncio.create_task(request())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert _run(eric, body) == ["lease-3"]


def test_handed_over_none_and_given_back_early_not_again(eric) -> None:
    async def handed(leases: Leases, url: str) -> None:
        async with leases:
            leases.hold([_item(url, 4)])
            leases.hand_over()

    async def early(leases: Leases, url: str) -> None:
        async with leases:
            leases.hold([_item(url, 5), _item(url, 6)])
            await leases.give_back([_item(url, 5).handle])
        # leaving without handing over: only the one still held goes back

    assert _run(eric, handed) == []
    assert _run(eric, early) == ["lease-5", "lease-6"]


def test_a_producer_the_gateway_does_not_know_is_never_acked(eric) -> None:
    async def body(leases: Leases, url: str) -> None:
        async with leases:
            leases.hold([_item("http://127.0.0.1:9", 7), _item(url, 8)])

    assert _run(eric, body) == ["lease-8"]
