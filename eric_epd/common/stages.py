"""A cheap Prometheus histogram for per-stage timings on hot paths (Eric's router and the gateway).

prometheus_client's Histogram takes two mutexes per observation (about 3 us here); this one is a bisect and two
additions (well under 1 us), rendered by a collector on scrape. It is lock-free, so observe it from one thread only:
both servers observe on their event loop (worker threads hand their timings back to it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""0.1 ms .. 10 s: sub-millisecond stages (hashing, pool reservation, answers) up to whole video batches."""


class StageHistogram(Collector):
    """One histogram family with one label whose values are fixed up front (every series is exported from the
    start, at zero). `observe(value, seconds)` from a single thread."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        values: Iterable[str],
        buckets: tuple[float, ...] = STAGE_BUCKETS,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._name, self._doc, self._label = name, documentation, label
        self._bounds = tuple(buckets)
        self._counts = {v: [0] * (len(self._bounds) + 1) for v in values}  # last slot: above every bound (+Inf)
        self._sums = dict.fromkeys(self._counts, 0.0)
        if registry is not None:
            registry.register(self)

    def observe(self, value: str, seconds: float) -> None:
        """One observation for the series `label=value` (a KeyError for a value not declared up front)."""
        self._counts[value][bisect_left(self._bounds, seconds)] += 1  # Prometheus buckets are `le`: x <= bound
        self._sums[value] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        """Prometheus collector hook: render the counts as one cumulative histogram series per label value."""
        family = HistogramMetricFamily(self._name, self._doc, labels=[self._label])
        for value, counts in self._counts.items():
            cumulative, buckets = 0, []
            for bound, n in zip((*map(str, self._bounds), "+Inf"), counts):
                cumulative += n
                buckets.append((bound, cumulative))
            family.add_metric([value], buckets, self._sums[value])
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        """Prometheus collector hook: the (empty) family this collector exports, for registration."""
        yield HistogramMetricFamily(self._name, self._doc, labels=[self._label])
