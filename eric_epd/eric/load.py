"""What an autoscaler needs from one Eric, over a sliding window: queue depth, the fraction of time the workers were
busy, items encoded per second and the p99 latency of encode requests, answered as a `wire.load.LoadReport`."""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from eric_epd.wire.load import WINDOW_S, LoadReport


class LoadTracker:
    """Fed by the router's event loop (batch stats from the engine, request latencies); single-threaded."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._started = time.monotonic()
        self._batches: deque[tuple[float, float, int]] = deque()  # (end, seconds, items)
        self._latencies: deque[tuple[float, float]] = deque()  # (end, seconds)
        self._queue_depth = 0

    def observe_batch(self, seconds: float, items: int) -> None:
        """Count one finished batch: its wall time and how many items it held."""
        self._batches.append((time.monotonic(), seconds, items))
        self._drop_old(self._batches)

    def observe_request(self, seconds: float) -> None:
        """Count one finished /v1/encode request's latency."""
        self._latencies.append((time.monotonic(), seconds))
        self._drop_old(self._latencies)

    def _drop_old(self, series: deque) -> None:
        """Samples older than the window go as new ones come: the series stay bounded with nobody reading them."""
        cutoff = time.monotonic() - self._window_s
        while series and series[0][0] < cutoff:
            series.popleft()

    def observe_queue(self, depth: int) -> None:
        """Record the engine's current queue depth (queued plus running items)."""
        self._queue_depth = depth

    def report(self) -> LoadReport:
        """The load over the window: old samples dropped, busy fraction, items per second and p99 latency."""
        now = time.monotonic()
        for series in (self._batches, self._latencies):
            self._drop_old(series)
        window = max(1e-3, min(self._window_s, now - self._started))
        busy = sum(min(s, self._window_s) for _, s, _ in self._batches)
        latencies = [s for _, s in self._latencies]
        return LoadReport(
            self._queue_depth,
            min(1.0, busy / window),
            sum(n for _, _, n in self._batches) / window,
            float(np.percentile(latencies, 99)) if latencies else 0.0,
            window,
        )
