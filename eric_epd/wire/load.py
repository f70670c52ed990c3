"""Load reports: what GET /v1/load on an Eric answers and what the gateway's placement and autoscaling read."""

from __future__ import annotations

import msgspec

WINDOW_S = 30.0


class LoadReport(msgspec.Struct, frozen=True):
    """One Eric's load over its recent window: what GET /v1/load answers."""

    queue_depth: int
    """Items accepted and not finished (queued or running)."""
    busy_fraction: float
    """Share of the window the workers spent running batches (1.0: saturated)."""
    items_per_s: float
    """Items encoded per second over the window."""
    p99_encode_s: float
    """99th percentile of /v1/encode latency over the window (0 when none finished)."""
    window_s: float
