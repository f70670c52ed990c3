"""Client media hosts are resolved by c-ares (eric_epd.media.resolver) against a nameserver that never answers (a
real UDP socket on loopback that reads and drops every query): each lookup ends with a 400 within its deadline, and
the system resolver the project's own upstreams use answers while dozens of them hang."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from eric_epd.media.resolver import MediaResolver
from eric_epd.media.url_policy import MediaError


@pytest.fixture(scope="module")
def black_hole() -> Iterator[tuple[str, list[bytes]]]:
    """A 'nameserver' on 127.0.0.1 that receives queries and never answers; the queries it got."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    got: list[bytes] = []
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            try:
                got.append(sock.recv(4096))
            except TimeoutError:
                continue

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    yield f"127.0.0.1:{sock.getsockname()[1]}", got
    stop.set()
    thread.join()
    sock.close()


def test_a_name_that_never_resolves_is_a_400_within_its_deadline(black_hole) -> None:
    server, got = black_hole

    async def go() -> MediaError:
        resolver = MediaResolver(timeout_s=0.3, tries=1, nameservers=[server])
        try:
            with pytest.raises(MediaError) as info:
                await resolver.resolve("never.example.com", 443)
            return info.value
        finally:
            await resolver.aclose()

    err = asyncio.run(go())
    assert err.status == 400 and "never.example.com" in err.message
    assert got, "the query reached the test's nameserver"  # negative control: the lookup really asked it


def test_hung_client_lookups_leave_the_system_resolver_free(black_hole) -> None:
    """Forty hung client lookups at once (the thread-pool resolver had 4 threads for everyone); the system resolver
    still answers localhost while every one of them is pending, and each ends in a 400."""
    server, _ = black_hole

    async def go() -> list[object]:
        resolver = MediaResolver(timeout_s=1.0, tries=2, nameservers=[server])
        loop = asyncio.get_running_loop()
        try:
            hung = [asyncio.create_task(resolver.resolve(f"h{i}.example.com", 80)) for i in range(40)]
            await asyncio.sleep(0.1)
            infos = await loop.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)
            assert infos and not any(task.done() for task in hung)
            return await asyncio.gather(*hung, return_exceptions=True)
        finally:
            await resolver.aclose()

    results = asyncio.run(go())
    assert all(isinstance(r, MediaError) and r.status == 400 for r in results), results


def test_hosts_file_names_resolve() -> None:
    async def go() -> list[str]:
        resolver = MediaResolver()
        try:
            return await resolver.resolve("localhost", 80)
        finally:
            await resolver.aclose()

    assert "127.0.0.1" in asyncio.run(go())
