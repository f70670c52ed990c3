"""The gateway's autoscaling signal: how many Erics the load it sees needs, from each Eric's own load report.

    demand      = sum of the Erics' busy fractions         (Erics' worth of worker time the load takes)
    backlog_s   = sum of queue depths / sum of items/s     (seconds to drain what is queued at today's rate)
    recommended = max(1, ceil(demand / target_busy)), and at least (Erics reporting + 1) while backlog_s exceeds
                  max_backlog_s (the queues grow: more Erics are needed whatever the busy time says)

With no report (no Eric answered /v1/load yet) it recommends the healthy count: no signal, no change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from eric_epd.wire.load import LoadReport

TARGET_BUSY = 0.7
"""Busy fraction each Eric should run at: headroom for bursts and for one Eric failing."""
MAX_BACKLOG_S = 2.0


def recommended_encoders(
    reports: Sequence[LoadReport], healthy: int, target_busy: float = TARGET_BUSY, max_backlog_s: float = MAX_BACKLOG_S
) -> int:
    """Erics needed: summed busy time over `target_busy`, plus one while the backlog exceeds `max_backlog_s`."""
    if not reports:
        return max(1, healthy)
    demand = sum(r.busy_fraction for r in reports)
    rate = sum(r.items_per_s for r in reports)
    queued = sum(r.queue_depth for r in reports)
    recommended = max(1, math.ceil(round(demand / target_busy, 6)))
    backlog_s = queued / rate if rate > 0 else (math.inf if queued else 0.0)
    if backlog_s > max_backlog_s:
        recommended = max(recommended, len(reports) + 1)
    return recommended
