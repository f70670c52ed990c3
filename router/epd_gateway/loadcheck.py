"""What the gateway believes of an Eric's load report (GET /v1/load): each field bounded, and no better than what the
gateway itself observes of that Eric, so an Eric that lies about its load cannot attract most of the items.

    queue_depth    clamped to [0, MAX_QUEUE], and never below the items this gateway has in flight to the Eric
    items_per_s    clamped to [0, MAX_ITEMS_PER_S], and at most OBSERVED_FACTOR times the items per second this
                   gateway saw the Eric answer over the report window (counted as at least 1 item/s, so a fresh Eric
                   is not taken for a stuck one; the factor leaves room for work other gateways send it)
    busy_fraction  clamped to [0, 1];  p99_encode_s and window_s to [0, MAX_SECONDS]

A field that is not a finite number counts as 0.
"""

from __future__ import annotations

import math
import time
from collections import deque

from eric_epd.wire.load import WINDOW_S, LoadReport

MAX_QUEUE = 1_000_000
MAX_ITEMS_PER_S = 100_000.0
MAX_SECONDS = 3600.0
OBSERVED_FACTOR = 4.0
"""A report's items/s is believed up to this multiple of what this gateway saw the Eric answer."""


def _bounded(value: float, high: float) -> float:
    return min(max(value, 0.0), high) if math.isfinite(value) else 0.0


class Completions:
    """Items one Eric answered this gateway over the last `window_s` (fed and read by the event loop only)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._since = time.monotonic()
        self._answered: deque[tuple[float, int]] = deque()  # (when, items)
        self._total = 0

    def add(self, items: int) -> None:
        """Count `items` answered now (older counts leave the window here too: bounded with nobody reading)."""
        self._answered.append((time.monotonic(), items))
        self._total += items
        self._drop_old(time.monotonic())

    def per_s(self) -> float:
        """Items per second over the window (or since this Eric was first seen, if later; at least 1 s)."""
        now = time.monotonic()
        self._drop_old(now)
        return self._total / max(1.0, min(self._window_s, now - self._since))

    def _drop_old(self, now: float) -> None:
        while self._answered and self._answered[0][0] < now - self._window_s:
            self._total -= self._answered.popleft()[1]


def believed_load(report: LoadReport, inflight_items: int, observed_per_s: float) -> LoadReport:
    """The report as the gateway acts on it (see the module's docstring)."""
    queue = max(int(_bounded(float(report.queue_depth), MAX_QUEUE)), inflight_items)
    rate = min(_bounded(report.items_per_s, MAX_ITEMS_PER_S), OBSERVED_FACTOR * max(observed_per_s, 1.0))
    return LoadReport(
        queue,
        _bounded(report.busy_fraction, 1.0),
        rate,
        _bounded(report.p99_encode_s, MAX_SECONDS),
        _bounded(report.window_s, MAX_SECONDS),
    )
