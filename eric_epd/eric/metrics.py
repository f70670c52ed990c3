"""Prometheus metrics of one Eric server, in a registry owned by the app (no global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eric_epd.common.stages import STAGE_BUCKETS, StageHistogram
from eric_epd.eric.load import LoadTracker
from eric_epd.runtime.engine.messages import EngineStatusMsg, WorkResultMsg
from eric_epd.transfer.global_cache import GlobalCache
from eric_epd.transfer.pool import EmbeddingPool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

STAGES = (
    "body_read",
    "fetch",
    "decode",
    "preprocess",
    "hash",
    "pool_reserve",
    "engine_queue",
    "batch_compute",
    "pool_write",
    "answer",
)
"""eric_stage_seconds{stage}: body_read, fetch (media incl. download), decode, preprocess (HF-equal), hash (per
item); pool_reserve (per engine request); engine_queue (per engine request: its time in the engine outside its own
batches); batch_compute (rank 0's forward), pool_write (rank 0's copy into the pool) per batch; answer (the JSON)."""


class EricMetrics:
    """The Eric's Prometheus series (engine, requests, stages, caches, load), all in its own `registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("eric_queue_depth", "Items accepted and not yet finished (engine view)", registry=r)
        self.inflight_items = Gauge("eric_inflight_items", "Items submitted to the engine by this router", registry=r)
        self.batches = Counter(
            "eric_batches", "Executed batches by the modalities they held", ["modalities"], registry=r
        )
        self.batch_items = Histogram(
            "eric_batch_items", "Items per batch", ["modality"], buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_patches = Histogram(
            "eric_batch_patches",
            "Vision patches per batch",
            ["modality"],
            buckets=(64, 256, 1024, 4096, 16384, 65536),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "eric_batch_seconds", "Engine time per batch", ["modality"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.encode_latency = Histogram(
            "eric_encode_latency_seconds", "Latency of /v1/encode requests", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.items = Counter(
            "eric_items",
            "Items answered, by modality and source (encoded, cached, global)",
            ["modality", "source"],
            registry=r,
        )
        self.alias_hits = Counter(
            "eric_alias_hits",
            "Items answered through the raw-bytes alias (--alias-entries): their embedding was still in the pool, "
            "so they were not decoded, preprocessed or hashed again",
            ["modality"],
            registry=r,
        )
        self.requests = Counter("eric_requests", "Encode requests by HTTP status", ["status"], registry=r)
        self.stages = StageHistogram(
            "eric_stage_seconds", "Time per stage of the encode path", "stage", STAGES, registry=r
        )
        self.overhead = Histogram(
            "eric_request_overhead_seconds",
            "A /v1/encode request's wall time minus the forward time of the batches it rode in",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.load = LoadTracker()
        self.global_cache: GlobalCache | None = None
        self.global_events = Gauge(
            "eric_global_cache", "Global cache (Mooncake Store) counters since start", ["event"], registry=r
        )
        self.pool: EmbeddingPool | None = None
        self.local_events = Gauge(
            "eric_local_cache",
            "This Eric's content cache (acknowledged embeddings kept in its "
            "pool): bytes held, capacity (--keep-acked-bytes), evictions since start",
            ["event"],
            registry=r,
        )
        self.busy = Gauge("eric_busy_fraction", "Share of the last 30 s the workers ran batches", registry=r)
        self.items_rate = Gauge("eric_items_per_second", "Items encoded per second over the last 30 s", registry=r)
        self.p99 = Gauge("eric_encode_latency_p99_seconds", "p99 of /v1/encode latency over the last 30 s", registry=r)
        self.sglang_state: Callable[[], dict[str, int]] | None = None
        self.sglang = Gauge(
            "eric_sglang_state",
            "What SGLang's encoder protocol holds: parts (req_ids) and cached receiver sockets",
            ["kind"],
            registry=r,
        )

    def observe_status(self, status: EngineStatusMsg) -> None:
        """Fold an engine status message into the queue gauge, the load tracker and the per-batch series."""
        self.queue_depth.set(status.queued_items + status.running_items)
        self.load.observe_queue(status.queued_items + status.running_items)
        for b in status.batches:
            self.load.observe_batch(b.seconds, b.num_items)
            modality = "+".join(k.partition("/")[0] for k in b.kinds)  # the generic path's kinds add shapes
            self.batches.labels(modalities=modality).inc()
            self.batch_items.labels(modality=modality).observe(b.num_items)
            self.batch_patches.labels(modality=modality).observe(b.cost)
            self.batch_seconds.labels(modality=modality).observe(b.seconds)
            self.stages.observe("batch_compute", b.compute_seconds)
            self.stages.observe("pool_write", b.write_seconds)

    def observe_item(self, fetch_seconds: float | None, seconds: tuple[float, float, float] | None) -> None:
        """One item's fetch (None: a data: URL the alias knew, not fetched), then its decode, preprocessing and
        hashing (PreparedItem.seconds; None for an alias hit, which had none)."""
        stages = self.stages
        if fetch_seconds is not None:
            stages.observe("fetch", fetch_seconds)
        if seconds is None:
            return
        stages.observe("decode", seconds[0])
        stages.observe("preprocess", seconds[1])
        stages.observe("hash", seconds[2])

    def observe_result(self, result: WorkResultMsg) -> float:
        """An engine request's queue wait; returns the forward time of the batches it rode in."""
        if not result.batches:
            return 0.0
        self.stages.observe("engine_queue", result.queue_seconds)
        return sum(b.compute_seconds for b in result.batches)

    def observe_request(self, seconds: float) -> None:
        """Count one /v1/encode request's latency, in the histogram and the load tracker."""
        self.encode_latency.observe(seconds)
        self.load.observe_request(seconds)

    def render(self) -> bytes:
        """The registry in Prometheus text format, after refreshing the gauges read on scrape (caches, SGLang, load)."""
        if self.global_cache is not None:
            stats = self.global_cache.counters()
            for event in ("hits", "misses", "puts", "bytes_read", "bytes_written", "errors", "up", "capacity"):
                self.global_events.labels(event=event).set(float(getattr(stats, event)))
        if self.pool is not None:
            for event, value in (
                ("bytes", self.pool.cached_bytes),
                ("capacity", self.pool.cache_budget),
                ("evictions", self.pool.evictions),
            ):
                self.local_events.labels(event=event).set(float(value))
        if self.sglang_state is not None:
            for kind, value in self.sglang_state().items():
                self.sglang.labels(kind=kind).set(float(value))
        report = self.load.report()
        self.busy.set(report.busy_fraction)
        self.items_rate.set(report.items_per_s)
        self.p99.set(report.p99_encode_s)
        return generate_latest(self.registry)
