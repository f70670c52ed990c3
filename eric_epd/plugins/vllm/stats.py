"""Counters of the Eric connector, reported through vLLM's EC connector stats and Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

COUNTERS = {
    "external_items": "Multimodal items whose embeddings were scheduled to load from Eric",
    "local_encoder_items": "Multimodal items vLLM's own encoder was scheduled to encode",
    "loaded_items": "Embeddings fetched from Eric into the encoder cache",
    "loaded_bytes": "Bytes fetched from Eric",
    "load_failures": "Embeddings that could not be fetched (their requests fail)",
    "unavailable_requests": "Requests failed because an item was at no Eric and had no raw media",
    "released_items": "Eric items never fetched for their request (vLLM had them cached) whose lease was returned",
    "via_shm": "Embeddings that came over shared memory (Eric on this host)",
    "via_nixl": "Embeddings that came over NIXL (UCX: RDMA or TCP)",
    "via_mooncake": "Embeddings that came over Mooncake TransferEngine",
    "via_http": "Embeddings that came over HTTP (the fallback)",
    "via_store": "Embeddings read from the global cache (Mooncake Store) after their producer let them go",
    "unusable_transport": "Fetches that skipped a transport the handle offered but this engine cannot use (e.g. "
    "Mooncake over rdma with a tcp consumer); the log says why, once",
}


@dataclass
class EricECStats(ECConnectorStats):
    """The connector's counters by name, as vLLM's EC connector stats."""

    data: dict[str, Any] = field(default_factory=dict)

    def record(self, **counts: int) -> None:
        """Add the non-zero `counts` to the counters."""
        for key, n in counts.items():
            if n:
                self.data[key] = self.data.get(key, 0) + n

    def reset(self) -> None:
        """vLLM hook: clear every counter."""
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> EricECStats:
        """vLLM hook: these counters plus another's, as new stats."""
        merged = EricECStats(dict(self.data))
        merged.record(**other.data)
        return merged

    def reduce(self) -> dict[str, int | float]:
        """vLLM hook: the counters as a plain dict, for logging."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """vLLM hook: whether nothing was counted."""
        return not self.data


class EricECPromMetrics(ECConnectorPromMetrics):
    """vllm:eric_ec_<counter>_total, one series per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: {
                engine: self._counter_cls(name=f"vllm:eric_ec_{key}", documentation=doc, labelnames=labelnames).labels(
                    *values
                )
                for engine, values in per_engine_labelvalues.items()
            }
            for key, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """vLLM hook: add an interval's counters to engine `engine_idx`'s Prometheus series."""
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
