"""Reading a server's Prometheus text: a histogram's totals summed over its label sets, or per value of one label."""

from __future__ import annotations

import re

import httpx


def scrape(server_url: str) -> str:
    """The text exposition at `server_url`/metrics."""
    return httpx.get(server_url + "/metrics", timeout=30).text


def _samples(text: str, name: str) -> list[tuple[str, str, float]]:
    """(part: "sum" or "count", label text inside the braces, value) of every sample of histogram `name`."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        family, _, labels = metric.partition("{")
        for part in ("sum", "count"):
            if family == f"{name}_{part}":
                out.append((part, labels[:-1] if labels.endswith("}") else labels, float(value)))
    return out


def totals(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` in the exposition `text`, over every label set."""
    total = count = 0.0
    for part, _, value in _samples(text, name):
        if part == "sum":
            total += value
        else:
            count += value
    return total, count


def totals_by_label(text: str, name: str, label: str) -> dict[str, tuple[float, float]]:
    """label value -> (sum, count) of histogram `name` in the exposition `text` (samples without `label` left out)."""
    out: dict[str, tuple[float, float]] = {}
    pattern = re.compile(rf'(?:^|,){re.escape(label)}="((?:[^"\\]|\\.)*)"')
    for part, labels, value in _samples(text, name):
        if (m := pattern.search(labels)) is None:
            continue
        total, count = out.get(m.group(1), (0.0, 0.0))
        out[m.group(1)] = (total + value, count) if part == "sum" else (total, count + value)
    return out


def histogram_totals(server_url: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` on `server_url`/metrics, over every label set."""
    return totals(scrape(server_url), name)
