"""Eric's load report over its sliding window, without processes: the figures cover the window only, and the samples
behind them stay bounded when nobody asks for a report (no gateway, no Prometheus)."""

from __future__ import annotations

import time

import pytest

from eric_epd.eric.load import LoadTracker


def test_samples_stay_within_the_window_unread_and_the_report_counts_only_them(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    tracker = LoadTracker(window_s=10.0)
    for _ in range(1000):  # 1000 s of traffic, one request and one batch of 2 items a second, nobody reading
        clock[0] += 1.0
        tracker.observe_request(9.0 if clock[0] > 1090 else 0.5)
        tracker.observe_batch(0.25, 2)
    assert len(tracker._batches) <= 11 and len(tracker._latencies) <= 11
    report = tracker.report()
    assert report.window_s == 10.0
    assert report.items_per_s == pytest.approx(2.0, rel=0.11)  # 10 or 11 batches of 2 in the last 10 s
    assert report.busy_fraction == pytest.approx(0.25, rel=0.11)
    assert report.p99_encode_s == pytest.approx(9.0)  # the old, fast requests are gone
