"""What the connector's two sides tell each other once per engine step: the scheduler the workers which staged
items to load, the workers the scheduler what they copied and what failed."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata

from eric_epd.plugins.vllm.staging import StagedLoad
from eric_epd.plugins.vllm.stats import EricECStats


@dataclass
class EricLoad:
    """Scheduler -> workers: one embedding a request loads in this step, and where it was staged."""

    request_id: str
    mm_hash: str
    staged: StagedLoad


@dataclass
class EricECMetadata(ECConnectorMetadata):
    """Scheduler -> workers, once per step: staged items to copy into the encoder cache."""

    loads: list[EricLoad] = field(default_factory=list)


@dataclass
class EricWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: items copied out of staging (their space can be reused), requests
    whose copy failed, items a rank had no copy of (zeros stand in for them in vLLM's encoder cache) and counters
    (vLLM collects connector stats on the scheduler side only)."""

    failed_request_ids: set[str] = field(default_factory=set)
    copied: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)
    unlanded: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """vLLM hook: merge another worker's metadata into this one (failures, copies and counters summed)."""
        assert isinstance(other, EricWorkerMetadata)
        merged = EricECStats(dict(self.counts))
        merged.record(**other.counts)
        return EricWorkerMetadata(
            self.failed_request_ids | other.failed_request_ids,
            self.copied | other.copied,
            merged.data,
            self.unlanded | other.unlanded,
        )
