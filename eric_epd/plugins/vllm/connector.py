"""EricECConnector: vLLM's encoder-cache connector (consumer role) backed by Eric, split by role as vLLM's own
connectors are: the scheduler side (scheduler_side.py, EngineCore process) takes each request's Eric handles and
prefetches its items; the worker side (worker_side.py, each vLLM worker) lands them and hands them to vLLM's encoder
cache. This class only tells vLLM's hooks to the side its role builds."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from eric_epd.plugins.vllm.landing import LandingAddress
from eric_epd.plugins.vllm.scheduler_side import EricScheduler
from eric_epd.plugins.vllm.settings import EricConnectorSettings
from eric_epd.plugins.vllm.stats import EricECStats
from eric_epd.plugins.vllm.step_meta import EricECMetadata, EricLoad, EricWorkerMetadata
from eric_epd.plugins.vllm.worker_side import EricWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["EricECConnector", "EricECMetadata", "EricLoad", "EricWorkerMetadata"]


def check_topology(parallel: Any) -> None:
    """ValueError for a layout the connector cannot serve: its landing area is one host's shared memory and its
    workers' sockets are named by tensor-parallel rank, so pipeline stages or prefill context-parallel groups (whose
    ranks would bind the same names: the last one takes every order, and the first lands nothing) and workers on
    other nodes cannot take part."""
    stages, nodes = getattr(parallel, "pipeline_parallel_size", 1), getattr(parallel, "nnodes", 1)
    contexts = getattr(parallel, "prefill_context_parallel_size", 1)
    for name, size in (("pipeline", stages), ("prefill context", contexts)):
        if size > 1:
            raise ValueError(
                f"EricECConnector does not support {name} parallelism (size {size}); use tensor parallelism on one node"
            )
    if nodes > 1:
        raise ValueError(f"EricECConnector lands embeddings on one node; this engine spans {nodes} nodes")


def dp_index(parallel: Any) -> int:
    """The engine's data-parallel index, which names its landing sockets. Not `data_parallel_rank`: vLLM sets that to
    0 in every engine of a dense model's data parallelism (each runs as an independent rank, with the same instance
    id), so their schedulers and workers would share one set of sockets, orders crossing between engines."""
    return int(getattr(parallel, "data_parallel_index", getattr(parallel, "data_parallel_rank", 0)))


class EricECConnector(ECConnectorBase):
    """vLLM's encoder-cache connector in the consumer role: Eric items fetched and landed, then handed to vLLM."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if not self.is_consumer or self.is_producer:
            raise ValueError("EricECConnector is a consumer: use ec_role 'ec_consumer' (Eric is the producer)")
        assert vllm_config.ec_transfer_config is not None
        check_topology(vllm_config.parallel_config)
        settings = EricConnectorSettings.parse(vllm_config.ec_transfer_config.ec_connector_extra_config)
        address = LandingAddress(vllm_config.instance_id, dp_index(vllm_config.parallel_config))
        self.scheduler: EricScheduler | None = None
        self.worker: EricWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self.scheduler = EricScheduler(vllm_config, settings, address)
        else:
            self.worker = EricWorker(settings, address, vllm_config.model_config.dtype)

    def _scheduler(self) -> EricScheduler:
        assert self.scheduler is not None, "a scheduler-side hook called on a worker"
        return self.scheduler

    def _worker(self) -> EricWorker:
        assert self.worker is not None, "a worker-side hook called on the scheduler"
        return self.worker

    # ---- scheduler side --------------------------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        """vLLM hook (scheduler_side.EricScheduler.has_cache_item)."""
        return self._scheduler().has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """vLLM hook (scheduler_side.EricScheduler.ensure_cache_available)."""
        return self._scheduler().ensure_cache_available(request, num_computed_tokens)

    def take_unavailable_requests(self) -> set[str]:
        """vLLM hook: the requests failed since the last call (the scheduler fails them), forgotten here."""
        return self._scheduler().take_unavailable_requests()

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """vLLM hook: queue the staged item at `index` for loading in this step."""
        self._scheduler().update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """vLLM hook: this step's loads for the workers."""
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """vLLM hook: take in the workers' copies, failed requests and counters."""
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """vLLM hook: give back the leases of the request's items it never fetched."""
        return self._scheduler().request_finished(request)

    def has_pending_push_work(self) -> bool:
        """vLLM hook: keep the engine loop alive while fetches run."""
        return self._scheduler().has_pending_push_work()

    # ---- worker side -----------------------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """vLLM hook: put each of this step's loads into vLLM's encoder cache, from this rank's landed copy."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, EricECMetadata)
        self._worker().start_load_caches(meta, encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Consumer only: nothing to save."""

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        """vLLM hook: this rank's copies, failures and counters since the last step, or None when there are none."""
        return self._worker().build_connector_worker_meta()

    # ---- both ------------------------------------------------------------------------------------------------

    def get_ec_connector_stats(self) -> EricECStats | None:
        """vLLM hook: the counters since the last call (then reset), or None when nothing was counted."""
        side = self.scheduler if self.scheduler is not None else self.worker
        assert side is not None
        if side.stats.is_empty():
            return None
        stats, side.stats = side.stats, EricECStats()
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> EricECStats:
        """vLLM hook: `EricECStats` over `data`."""
        return EricECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):  # -> EricECPromMetrics
        """vLLM hook: the connector's Prometheus counters (`EricECPromMetrics`)."""
        from eric_epd.plugins.vllm.stats import EricECPromMetrics

        return EricECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """vLLM hook: close this role's side."""
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()
