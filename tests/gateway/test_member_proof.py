"""An Eric found by name proves it holds the Erics' key before the gateway sends it the key or media: the pool's real
prover against Eric's own answering function served on real sockets (127.0.0.5), a stranger that cannot prove it
(127.0.0.7) and a stranger that relays the challenge to the real Eric (127.0.0.8); what each one was sent is
recorded."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from epd_gateway.encoders import EncoderPool
from epd_gateway.leases import release_leases
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.proof import MembershipProver
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from eric_epd.common.errors import ApiError
from eric_epd.common.registration import MEMBER_PROOF_PATH
from eric_epd.eric.app import member_proof_answer
from eric_epd.stack.process import free_port
from eric_epd.wire.handles import EmbeddingHandle

KEY = "the-erics-key"


def _app(kind: str, seen: list[tuple[str, str]], eric_url: str) -> Starlette:
    async def proof(request: Request) -> Response:
        seen.append((request.url.path, request.headers.get("authorization", "")))
        if kind == "eric":
            try:
                return member_proof_answer(KEY, request)
            except ApiError as e:
                return e.response()
        if kind == "relay":  # asks the real Eric with the same nonce and hands its answer on
            async with httpx.AsyncClient() as client:
                got = await client.get(eric_url + MEMBER_PROOF_PATH, params=dict(request.query_params))
            return Response(got.content, got.status_code, media_type="application/json")
        return JSONResponse({"proof": "00" * 32})

    async def other(request: Request) -> Response:
        seen.append((request.url.path, request.headers.get("authorization", "")))
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route(MEMBER_PROOF_PATH, proof),
            Route("/health", other),
            Route("/v1/load", other),
            Route("/v1/models", other),
            Route("/v1/embeddings/{content_hash}/ack", other, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def members() -> Iterator[dict[str, tuple[str, list[tuple[str, str]]]]]:
    port = free_port()
    eric_url = f"http://127.0.0.5:{port}"
    out, servers = {}, []
    for kind, address in (("eric", "127.0.0.5"), ("stranger", "127.0.0.7"), ("relay", "127.0.0.8")):
        seen: list[tuple[str, str]] = []
        server = uvicorn.Server(uvicorn.Config(_app(kind, seen, eric_url), host=address, port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        out[kind] = (f"http://{address}:{port}", seen)
    deadline = time.monotonic() + 10
    while not all(s.started for s in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield out
    for server in servers:
        server.should_exit = True


@asynccontextmanager
async def _pool(prove: bool) -> AsyncIterator[tuple[httpx.AsyncClient, EncoderPool]]:
    """A pool of Erics found by name, its keyed client beside it; `prove`: with the real prover (else names are
    trusted)."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as keyed, httpx.AsyncClient() as unkeyed:
        prover = MembershipProver(unkeyed, KEY) if prove else None
        yield keyed, EncoderPool((), keyed, None, GatewayMetrics(), 2, 5.0, prover=prover)


def _admit_all(urls: list[str], prove: bool) -> list[str]:
    async def go() -> list[str]:
        async with _pool(prove) as (_, pool):
            for url in urls:
                pool.admit(url)
            await pool.prove_new()
            await pool.probe_all()
            return sorted(m.url for m in pool.healthy())

    return asyncio.run(go())


def test_only_a_key_holder_is_admitted_and_strangers_never_see_the_key(members) -> None:
    for _, seen in members.values():
        seen.clear()
    urls = [url for url, _ in members.values()]
    assert _admit_all(urls, prove=True) == [members["eric"][0]]
    for kind in ("stranger", "relay"):
        seen = members[kind][1]
        assert seen and {path for path, _ in seen} == {MEMBER_PROOF_PATH}, seen  # challenged, then nothing more
        assert all(auth == "" for _, auth in seen), seen  # never the key
    eric_seen = members["eric"][1]
    assert (MEMBER_PROOF_PATH, "") in eric_seen  # the challenge itself carries no key
    assert ("/health", f"Bearer {KEY}") in eric_seen  # the keyed probe follows the proof
    relayed = len(members["relay"][1])  # the relay is challenged each round (it never proves)
    assert len([p for p, _ in eric_seen if p == MEMBER_PROOF_PATH]) == 1 + relayed >= 2  # its own, and relayed


def test_without_proofs_every_name_member_gets_the_key(members) -> None:
    """Negative control: with names trusted (no prover), the stranger is admitted and probed with the key."""
    for _, seen in members.values():
        seen.clear()
    urls = [url for url, _ in members.values()]
    assert _admit_all(urls, prove=False) == sorted(urls)
    assert ("/health", f"Bearer {KEY}") in members["stranger"][1]


def _ack_after_they_left(urls: list[str], prove: bool) -> None:
    """Members found by name, then gone from it (their addresses may change hands), each with a lease to give back."""

    async def go() -> None:
        async with _pool(prove) as (keyed, pool):
            for url in urls:
                pool.admit(url)
                pool.dismiss(url)
            handles = [EmbeddingHandle("ab" * 32, (1, 8), "float32", 32, u, "i", f"{u}/e", lease="t") for u in urls]
            await release_leases(keyed, pool.vouch, handles)

    asyncio.run(go())


def test_a_lease_is_given_back_with_the_key_only_to_an_address_that_proves_it_holds_it(members) -> None:
    for _, seen in members.values():
        seen.clear()
    _ack_after_they_left([url for url, _ in members.values()], prove=True)
    ack = ("/v1/embeddings/" + "ab" * 32 + "/ack", f"Bearer {KEY}")
    assert ack in members["eric"][1]  # it proved itself: its lease is given back
    for kind in ("stranger", "relay"):
        assert {path for path, _ in members[kind][1]} == {MEMBER_PROOF_PATH}, members[kind][1]  # challenged only
        assert all(auth == "" for _, auth in members[kind][1])
    for _, seen in members.values():  # negative control: without proofs the stranger gets the ack and the key
        seen.clear()
    _ack_after_they_left([url for url, _ in members.values()], prove=False)
    assert ack in members["stranger"][1]


def test_eric_refuses_bad_nonces(members) -> None:
    url = members["eric"][0]
    for nonce in ("", "xyz", "AB" * 16, "0" * 129):
        resp = httpx.get(url + MEMBER_PROOF_PATH, params={"nonce": nonce})
        assert resp.status_code == 400 and "nonce" in resp.json()["error"]["message"], nonce
