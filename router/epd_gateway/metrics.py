"""Prometheus metrics of the gateway, in a registry the app owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eric_epd.common.stages import StageHistogram

STAGES = ("body_read", "validate", "encode", "rewrite", "inline")
"""gateway_stage_seconds{stage}: body_read (read and parse), validate (the boundary checks, media collection and
the URL policy), encode (the whole call to the Erics, EPD only), rewrite (media parts to keyed embeds, EPD only)."""
UPSTREAMS = ("encoder", "prefill", "decode", "colocated")
"""gateway_upstream_seconds{upstream}: from sending a call until the upstream's response headers arrived."""

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    """The gateway's Prometheus series (requests, latency, encoders, upstreams, stages), in its own `registry`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gateway_requests", "Requests by path (epd, pd, fallback)", ["path"], registry=r)
        self.latency = Histogram(
            "gateway_request_seconds", "End-to-end latency by path", ["path"], buckets=_BUCKETS, registry=r
        )
        self.encode_latency = Histogram(
            "gateway_encode_seconds", "Time spent in encoders per EPD request", buckets=_BUCKETS, registry=r
        )
        self.fanout = Histogram(
            "gateway_encoder_fanout",
            "Encoders one EPD request was spread over",
            buckets=(1, 2, 3, 4, 8, 16),
            registry=r,
        )
        self.failures = Counter("gateway_failures", "Failed upstream calls by stage", ["stage"], registry=r)
        self.failovers = Counter("gateway_failovers", "Encode calls retried on another encoder", registry=r)
        self.client_errors = Counter("gateway_client_errors", "Requests refused with a 4xx", ["status"], registry=r)
        self.encoders_healthy = Gauge("gateway_encoders_healthy", "Encoders currently admitted", registry=r)
        self.recommended_encoders = Gauge(
            "gateway_recommended_encoders", "Erics the load needs (epd_gateway/scaling.py's formula)", registry=r
        )
        self.stages = StageHistogram(
            "gateway_stage_seconds", "Time per stage of the gateway's own work", "stage", STAGES, registry=r
        )
        self.upstreams = StageHistogram(
            "gateway_upstream_seconds", "Time to each upstream's response headers", "upstream", UPSTREAMS, registry=r
        )

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
