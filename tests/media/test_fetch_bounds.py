"""The media fetcher's bounds against a real local HTTP server: Content-Encoding (asked for identity, one gzip or
deflate layer inflated within the item limit, stacked or unknown layers refused) and connection slots (per host,
per request), so one hostile origin costs the server its budget and no more; and what a failed connect tells the
client (no address)."""

from __future__ import annotations

import asyncio
import gzip
import sys
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eric_epd.media.encoding import inflate
from eric_epd.media.fetch import MAX_PER_HOST, ByteBudget, MediaFetcher
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError, UrlPolicy

LIMIT = 1 << 20
LIMITS = MediaLimits(max_bytes=LIMIT, timeout_s=20.0)
POLICY = UrlPolicy(host_allowlist=frozenset({"127.0.0.1", "127.0.0.2"}))
PAYLOAD = bytes(range(256)) * 64  # 16 KiB that compress well but not to nothing
BOMB = gzip.compress(b"\0" * (64 << 20), 9)  # 64 MiB of zeros in ~64 KiB
BODIES: dict[str, tuple[bytes, str]] = {
    "/gzip": (gzip.compress(PAYLOAD), "gzip"),
    "/deflate": (zlib.compress(PAYLOAD), "deflate"),
    "/raw-deflate": (zlib.compress(PAYLOAD)[2:-4], "deflate"),
    "/bomb": (BOMB, "gzip"),
    "/double": (gzip.compress(gzip.compress(b"\0" * (16 << 20))), "gzip, gzip"),
    "/br": (b"\x0b\x02\x80hello\x03", "br"),
    "/not-gzip": (b"plain bytes", "gzip"),
    "/two-members": (gzip.compress(b"a") + gzip.compress(b"b"), "gzip"),
    "/identity": (PAYLOAD, "identity"),
}


class _Origin(BaseHTTPRequestHandler):
    """Serves BODIES with their Content-Encoding; /hold/<n> waits for `release`; records what was asked."""

    protocol_version = "HTTP/1.1"
    accept: list[str] = []
    release = threading.Event()
    lock = threading.Lock()
    holding = 0
    most_held = 0

    def do_GET(self) -> None:
        type(self).accept.append(self.headers.get("Accept-Encoding", ""))
        if self.path.startswith("/hold/"):
            self._hold()
            return
        body, coding = BODIES[self.path]
        self.send_response(200)
        self.send_header("Content-Encoding", coding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _hold(self) -> None:
        cls = type(self)
        with cls.lock:
            cls.holding += 1
            cls.most_held = max(cls.most_held, cls.holding)
        cls.release.wait(30)
        with cls.lock:
            cls.holding -= 1
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A fetch refused mid-body resets its connection: expected here, not a traceback to print."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def origins() -> Iterator[tuple[str, str]]:
    """The same origin on 127.0.0.1 and on 127.0.0.2 (two hosts)."""
    servers = [_Server((host, 0), _Origin) for host in ("127.0.0.1", "127.0.0.2")]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tuple(f"http://{s.server_address[0]}:{s.server_address[1]}" for s in servers)  # type: ignore[misc]
    for server in servers:
        server.shutdown()
        server.server_close()


async def _get(url: str) -> bytes:
    fetcher = MediaFetcher(POLICY, LIMITS)
    try:
        return await fetcher.fetch(url)
    finally:
        await fetcher.aclose()


def _error(url: str) -> MediaError:
    with pytest.raises(MediaError) as info:
        asyncio.run(_get(url))
    return info.value


def test_media_is_asked_for_uncompressed_and_one_layer_is_inflated(origins) -> None:
    base, _ = origins
    _Origin.accept.clear()
    for path in ("/gzip", "/deflate", "/raw-deflate", "/identity"):
        assert asyncio.run(_get(base + path)) == PAYLOAD, path
    assert _Origin.accept == ["identity"] * 4


def test_a_compression_bomb_costs_the_item_limit_and_no_more(origins) -> None:
    base, _ = origins
    tracemalloc.start()
    try:
        err = _error(base + "/bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.status == 413 and f"over the size limit of {LIMIT} bytes" in err.message and "gzip" in err.message
    assert peak < 8 * LIMIT, peak  # the 64 MiB it inflates to is never built (it was, in full, before)
    # negative control: the same bytes inflate to 64 MiB when nothing bounds the output
    assert len(zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(BOMB)) == 64 << 20


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/double", 400, "2 content encodings (gzip, gzip)"),
        ("/br", 400, "content encoding 'br'"),
        ("/not-gzip", 400, "not valid gzip data"),
        ("/two-members", 400, "more than one member"),
    ],
)
def test_stacked_unknown_or_broken_encodings_are_refused(origins, path: str, status: int, words: str) -> None:
    err = _error(origins[0] + path)
    assert err.status == status and words in err.message, err.message


def test_inflate_counts_against_the_request_budget(origins) -> None:
    async def go() -> int:
        fetcher = MediaFetcher(POLICY, LIMITS)
        budget = ByteBudget(len(PAYLOAD) + 10, "over the request budget")
        try:
            await fetcher.fetch(origins[0] + "/gzip", budget)
            with pytest.raises(MediaError, match="over the request budget"):
                await fetcher.fetch(origins[0] + "/gzip", budget)
        finally:
            await fetcher.aclose()
        return budget.used

    assert asyncio.run(go()) == len(PAYLOAD)  # the inflated size counted, not the ~300 bytes sent


def test_inflate_is_bounded_exactly() -> None:
    data = gzip.compress(b"x" * 1000)
    assert inflate(data, "gzip", 1000, "u") == b"x" * 1000
    with pytest.raises(MediaError) as info:
        inflate(data, "gzip", 999, "u")
    assert info.value.status == 413
    with pytest.raises(MediaError, match="truncated"):
        inflate(data[:-12], "gzip", 1000, "u")


def test_slow_urls_on_one_host_hold_only_that_hosts_slots(origins) -> None:
    """Twenty requests for URLs that never finish on host A hold MAX_PER_HOST connections to it; a fetch from host B
    is answered while all twenty are still waiting."""
    first, second = origins

    async def go() -> bytes:
        fetcher = MediaFetcher(POLICY, LIMITS)
        _Origin.release.clear()
        try:
            slow = [asyncio.create_task(fetcher.fetch(f"{first}/hold/{i}")) for i in range(20)]
            for _ in range(200):
                if _Origin.holding >= MAX_PER_HOST:
                    break
                await asyncio.sleep(0.02)
            other = await fetcher.fetch(second + "/identity")
            assert not any(task.done() for task in slow)
            _Origin.release.set()
            assert await asyncio.gather(*slow) == [b"ok"] * 20
            return other
        finally:
            _Origin.release.set()
            await fetcher.aclose()

    _Origin.most_held = 0
    assert asyncio.run(go()) == PAYLOAD
    assert _Origin.most_held == MAX_PER_HOST


def test_one_request_runs_a_bounded_number_of_fetches_at_once(origins) -> None:
    first, second = origins

    async def go() -> None:
        fetcher = MediaFetcher(POLICY, LIMITS)
        budget = ByteBudget(LIMIT, "over", concurrency=3)
        _Origin.release.clear()
        try:
            urls = [f"{host}/hold/r{i}" for i in range(4) for host in (first, second)]
            tasks = [asyncio.create_task(fetcher.fetch(url, budget)) for url in urls]
            for _ in range(100):
                await asyncio.sleep(0.02)
            assert _Origin.holding == 3
            _Origin.release.set()
            assert await asyncio.gather(*tasks) == [b"ok"] * 8
        finally:
            _Origin.release.set()
            await fetcher.aclose()

    asyncio.run(go())


def test_connect_failures_name_no_address() -> None:
    """aiohttp's text for a failed connect names the address it tried (an allowlisted name's internal IP): the
    reason a client gets is the errno's words only."""
    import errno

    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey

    from eric_epd.media.fetch import _describe

    key = ConnectionKey("internal.example", 80, False, True, None, None, None, None)
    error = aiohttp.ClientConnectorError(key, OSError(errno.EHOSTUNREACH, "Connect call failed ('10.0.0.5', 80)"))
    assert "10.0.0.5" in str(error)  # what would have leaked
    assert _describe(error) == "no route to host"
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "('10.0.0.5', 80)"))
    assert _describe(refused) == "connection refused"
