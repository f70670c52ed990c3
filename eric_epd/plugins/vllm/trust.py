"""The Erics the connector takes handles from: its `eric_urls`, and the current addresses of its `eric_dns` names
(e.g. a Kubernetes headless Service), resolved in a background thread, never on vLLM's loop; a name a handle names
is never looked up."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from eric_epd.common.dns import DnsTarget, is_address_url, resolve_urls_blocking

logger = logging.getLogger(__name__)

MIN_GAP_S = 0.5
"""Lookups of the names start at least this far apart, however many unknown producers ask for one."""
MAX_ASKING = 1024
"""Unknown producers awaiting a fresh lookup at once; past this one is refused outright."""


class TrustedProducers:
    """`producer in trusted` (a configured URL, or `http://ADDR:PORT` with ADDR among a name's last answer).

    A producer of the names' shape (an address and a configured port) that the last answer lacks may be an Eric that
    just joined: `settled` then asks for a lookup that starts after it and answers False until that lookup ended
    (or `wait_s` passed), so a request from a new Eric waits a moment instead of failing."""

    def __init__(
        self, urls: Iterable[str], targets: Iterable[DnsTarget] = (), interval_s: float = 2.0, wait_s: float = 5.0
    ) -> None:
        self._urls = frozenset(urls)
        self._targets = tuple(targets)
        self._ports = frozenset(t.port for t in self._targets)
        self._interval_s = interval_s
        self._wait_s = wait_s
        self._found: dict[DnsTarget, frozenset[str]] = {}  # replaced whole by the thread
        self._started = 0  # lookups (of every name) begun, and ended
        self._ended = 0
        self._asking: OrderedDict[str, tuple[int, float]] = OrderedDict()  # producer -> (lookup it awaits, deadline)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if self._targets:
            self._thread = threading.Thread(target=self._run, name="eric-dns", daemon=True)
            self._thread.start()

    @property
    def by_name(self) -> bool:
        """Whether any producers come from names (else `settled` is always True)."""
        return bool(self._targets)

    def _members(self) -> frozenset[str]:
        return frozenset().union(*self._found.values()) if self._found else frozenset()

    def __contains__(self, producer: object) -> bool:
        return producer in self._urls or any(producer in urls for urls in list(self._found.values()))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._urls | self._members()))

    def __len__(self) -> int:
        return len(self._urls | self._members())

    def settled(self, producers: Iterable[str]) -> bool:
        """False while one of `producers` waits for a lookup of the names that started after it was first seen;
        True once each is trusted or known not to be (the handle check then refuses it). Scheduler thread only."""
        return all([self._settled(p) for p in set(producers)])

    def _settled(self, producer: str) -> bool:
        if producer in self or not self._targets or not is_address_url(producer, self._ports):
            self._asking.pop(producer, None)
            return True
        asked = self._asking.get(producer)
        if asked is None:
            self._forget_stale()
            if len(self._asking) >= MAX_ASKING:
                return True
            self._asking[producer] = (self._started + 1, time.monotonic() + self._wait_s)
            self._wake.set()
            return False
        if self._ended >= asked[0] or time.monotonic() >= asked[1]:
            del self._asking[producer]  # decided: it is not among the names' members
            logger.warning("Eric %s is not among %s's addresses", producer[:200], [str(t) for t in self._targets])
            return True
        return False

    def _forget_stale(self) -> None:
        """Drop the asks no request came back for (its request ended while it waited) well past their deadline."""
        cutoff = time.monotonic() - self._wait_s
        while self._asking and next(iter(self._asking.values()))[1] < cutoff:
            self._asking.popitem(last=False)

    def asking(self) -> bool:
        """Whether a producer still waits for a lookup (the scheduler then idles a moment rather than spin)."""
        now = time.monotonic()
        return any(self._ended < need and now < deadline for need, deadline in self._asking.values())

    def _lookup(self, target: DnsTarget) -> None:
        try:
            urls = resolve_urls_blocking(target)
        except (OSError, ValueError) as e:
            logger.warning(
                "cannot resolve %s (%r): keeping its %d addresses", target, e, len(self._found.get(target, ()))
            )
            return
        if urls != self._found.get(target):
            logger.info("%s resolves to %s", target, sorted(urls) or "nothing")
            self._found = {**self._found, target: urls}

    def _run(self) -> None:
        last = float("-inf")
        while not self._closed.is_set():
            self._wake.wait(max(0.0, last + self._interval_s - time.monotonic()))
            if self._closed.wait(max(0.0, last + MIN_GAP_S - time.monotonic())):
                return
            self._wake.clear()
            self._started += 1
            last = time.monotonic()
            for target in self._targets:
                try:
                    self._lookup(target)
                except Exception:  # never let the thread die: the names would never be looked up again
                    logger.exception("looking up %s failed", target)
            self._ended = self._started

    def close(self) -> None:
        """Stop the DNS lookup thread."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
