"""Reading a server's Prometheus text: a histogram's totals summed over its label sets."""

from __future__ import annotations

import httpx


def histogram_totals(server_url: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` on `server_url`/metrics, over every label set."""
    total = count = 0.0
    for line in httpx.get(server_url + "/metrics", timeout=30).text.splitlines():
        metric, _, value = line.rpartition(" ")
        family = metric.split("{", 1)[0]
        if family == name + "_sum":
            total += float(value)
        elif family == name + "_count":
            count += float(value)
    return total, count
