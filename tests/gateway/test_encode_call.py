"""The gateway's encode call (epd_gateway/encode_call.py) against a raw asyncio HTTP server: a pooled keep-alive
connection the Eric closed is retried once on a fresh one, with the same body; an Eric that drops every connection
fails the call after that one retry (no more)."""

from __future__ import annotations

import asyncio

import aiohttp
from epd_gateway.encode_call import new_encoder_session, post_encode
from epd_gateway.metrics import GatewayMetrics

ANSWER = b'{"model":"m","items":[]}'


class DroppingEric:
    """Answers POST /v1/encode with ANSWER, except the requests whose number (from 0) is in `drop`: their
    connection is closed without a word. Records each request's body and connection number."""

    def __init__(self, drop: set[int]) -> None:
        self.drop = drop
        self.seen: list[tuple[int, bytes, str]] = []  # (connection, body, authorization)
        self._connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection, self._connections = self._connections, self._connections + 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.decode().split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers["content-length"]))
                self.seen.append((connection, body, headers.get("authorization", "")))
                if len(self.seen) - 1 in self.drop:
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(ANSWER)}\r\n\r\n".encode()
                    + ANSWER
                )
                await writer.drain()
        except asyncio.IncompleteReadError:
            return
        finally:
            writer.close()


async def _calls(eric: DroppingEric, bodies: list[bytes]) -> list[int | BaseException]:
    server = await asyncio.start_server(eric.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    out: list[int | BaseException] = []
    try:
        async with new_encoder_session({"Authorization": "Bearer k"}) as session:
            for body in bodies:
                try:
                    reply = await post_encode(session, url, body, 5.0, GatewayMetrics())
                    assert reply.body == ANSWER and reply.headers["content-type"] == "application/json"
                    out.append(reply.status)
                except aiohttp.ClientError as e:
                    out.append(e)
    finally:
        server.close()
        await server.wait_closed()
    return out


def test_a_keep_alive_connection_the_eric_closed_is_retried_once_on_a_fresh_one() -> None:
    eric = DroppingEric(drop={1})  # the second request, sent on the first connection, is dropped
    assert asyncio.run(_calls(eric, [b"one", b"two"])) == [200, 200]
    assert [(c, b) for c, b, _ in eric.seen] == [(0, b"one"), (0, b"two"), (1, b"two")]
    assert {a for _, _, a in eric.seen} == {"Bearer k"}  # the Erics' key on every call, the retry's too


def test_an_eric_that_drops_every_call_fails_it_after_one_retry() -> None:
    eric = DroppingEric(drop=set(range(10)))
    [outcome] = asyncio.run(_calls(eric, [b"one"]))
    assert isinstance(outcome, aiohttp.ServerDisconnectedError)
    assert [(c, b) for c, b, _ in eric.seen] == [(0, b"one"), (1, b"one")]  # tried twice, never more
