"""Erics found by name (--encoder-dns NAME:PORT, e.g. a Kubernetes headless Service): each name is resolved every
--dns-interval seconds; an address that appears is admitted, one gone from the answer is removed (calls in flight to
it finish); a failed lookup keeps the members it found last."""

from __future__ import annotations

import asyncio
import logging

from epd_gateway.encoders import EncoderPool
from eric_epd.common.dns import DnsTarget, resolve_urls

logger = logging.getLogger(__name__)


class DnsMembers:
    """Keeps the pool's name-listed members equal to what the names resolve to."""

    def __init__(
        self, targets: tuple[DnsTarget, ...], pool: EncoderPool, interval_s: float, lookup_timeout_s: float = 5.0
    ) -> None:
        self._targets = targets
        self._pool = pool
        self._interval_s = interval_s
        self._lookup_timeout_s = lookup_timeout_s
        self._found: dict[DnsTarget, frozenset[str]] = {}
        """Each name's last good answer."""
        self._listed: frozenset[str] = frozenset()
        """The URLs this admitted at the last refresh."""

    async def _lookup(self, target: DnsTarget) -> None:
        try:
            urls = await asyncio.wait_for(resolve_urls(target), self._lookup_timeout_s)
        except (TimeoutError, OSError, ValueError) as e:
            logger.warning(
                "cannot resolve %s (%r): keeping its %d members", target, e, len(self._found.get(target, ()))
            )
            return
        if urls != self._found.get(target):
            logger.info("%s resolves to %s", target, sorted(urls) or "nothing")
        self._found[target] = urls

    async def refresh(self) -> None:
        """Resolve every name once and bring the pool in line: new addresses admitted, vanished ones removed."""
        await asyncio.gather(*(self._lookup(t) for t in self._targets))
        current = frozenset().union(*self._found.values())
        for url in sorted(current):
            self._pool.admit(url)  # also one an admin removed by hand: the name still lists it
        for url in sorted(self._listed - current):
            self._pool.dismiss(url)
        self._listed = current
        await self._pool.prove_new()

    async def run(self) -> None:
        """Refresh every interval, until cancelled (the first refresh is the caller's, before serving)."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:  # never let one bad round stop membership
                logger.exception("refreshing the Erics found by name failed")
