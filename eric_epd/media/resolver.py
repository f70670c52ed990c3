"""Client media hosts resolved by c-ares (aiodns) on the event loop: no thread held per lookup, a deadline per
query, a cap on lookups at once. Apart from the system resolver the project's own upstreams use, so names a client
chose can stall only other clients' media lookups, and only for the deadline."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiodns

from eric_epd.media.url_policy import MediaError

logger = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 2.0
"""c-ares' own timeout for one query to one nameserver (it tries each nameserver `QUERY_TRIES` times)."""
QUERY_TRIES = 2
MAX_LOOKUPS = 64
"""Client media lookups in flight at once in one process; the rest wait their turn (within their fetch deadline)."""
MAX_HOSTS_PER_REQUEST = 16
"""Distinct media hosts one request may name."""


class MediaResolver:
    """One per process (per fetcher): a c-ares channel made on first use in the running loop."""

    def __init__(
        self,
        timeout_s: float = QUERY_TIMEOUT_S,
        tries: int = QUERY_TRIES,
        max_lookups: int = MAX_LOOKUPS,
        nameservers: list[str] | None = None,
    ) -> None:
        """`nameservers` ("ADDR" or "ADDR:PORT"): the system's (/etc/resolv.conf) when None."""
        self._timeout_s = timeout_s
        self._tries = tries
        self._nameservers = nameservers
        self._slots = asyncio.Semaphore(max_lookups)
        self._channel: aiodns.DNSResolver | None = None

    @property
    def deadline_s(self) -> float:
        """The longest one lookup may take before it is a 400."""
        return self._timeout_s * self._tries * 2 + 1.0

    async def resolve(self, name: str, port: int) -> list[str]:
        """The addresses `name` has (from /etc/hosts or DNS, A and AAAA), in the order c-ares gives; MediaError 400
        if it does not resolve within the deadline."""
        channel = self._channel_for(asyncio.get_running_loop())
        try:
            async with self._slots:
                result = await asyncio.wait_for(
                    channel.getaddrinfo(name, port=port, type=socket.SOCK_STREAM), self.deadline_s
                )
        except TimeoutError as exc:
            raise MediaError(400, f"could not resolve host {name!r}: no answer within {self.deadline_s:g} s") from exc
        except (aiodns.error.DNSError, UnicodeError, ValueError) as exc:
            raise MediaError(400, f"could not resolve host {name!r}") from exc
        addrs = [_text(node.addr[0]) for node in result.nodes]
        return list(dict.fromkeys(addrs))

    async def aclose(self) -> None:
        """Close the c-ares channel (pending lookups fail)."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _channel_for(self, loop: asyncio.AbstractEventLoop) -> aiodns.DNSResolver:
        if self._channel is None or self._channel.loop is not loop:
            self._channel = aiodns.DNSResolver(self._nameservers, loop=loop, timeout=self._timeout_s, tries=self._tries)
        return self._channel


def _text(addr: bytes | str) -> str:
    return addr.decode() if isinstance(addr, bytes) else addr
