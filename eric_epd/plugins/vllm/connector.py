"""EricECConnector: vLLM's encoder-cache connector (consumer role) backed by Eric.

Scheduler side (EngineCore process): each request brings the handles (with lease tokens) of its Eric items beside
it, in `sampling_params.extra_args` (the gateway writes them); they are checked (a configured Eric, the model's
embedding width, a consistent byte length) and looked up locally, with no network call; a request whose items can be
neither fetched nor encoded locally, or whose handles fail the checks, is failed alone.
Worker side (each vLLM worker): fetches the embedding over the configured transfer backend straight into vLLM's
encoder cache, with its rank's own lease, then acknowledges it to Eric.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from eric_epd.plugins.vllm.handoff import HandleError, model_embedding_width, offered_handles
from eric_epd.plugins.vllm.leases import LeaseClient, has_raw_media
from eric_epd.plugins.vllm.stats import EricECStats
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher, as_handle
from eric_epd.transfer.handles import BACKENDS, EmbeddingHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

API_KEY_ENV = "ERIC_API_KEY"
"""The Erics' API key reaches vLLM's processes through the environment, never a command line."""


@dataclass
class EricLoad:
    request_id: str
    mm_hash: str
    num_tokens: int
    handle: dict[str, Any]
    leases: list[str]
    """One lease token per tensor-parallel rank of this engine (rank i reads and acknowledges with leases[i])."""


@dataclass
class EricECMetadata(ECConnectorMetadata):
    """Scheduler -> workers, once per step: what to pull into the encoder cache."""

    loads: list[EricLoad] = field(default_factory=list)


@dataclass
class EricWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: requests whose embeddings could not be fetched, and counters
    (vLLM collects connector stats on the scheduler side only)."""

    failed_request_ids: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, EricWorkerMetadata)
        merged = EricECStats(dict(self.counts))
        merged.record(**other.counts)
        return EricWorkerMetadata(self.failed_request_ids | other.failed_request_ids, merged.data)


@dataclass(frozen=True)
class EricConnectorSettings:
    """`ec_connector_extra_config` keys and the ERIC_API_KEY environment variable, parsed once."""

    eric_urls: tuple[str, ...]
    backends: tuple[str, ...]
    lookup_timeout_s: float
    api_key: str | None

    @classmethod
    def parse(cls, extra: dict[str, Any], environ: dict[str, str] | os._Environ = os.environ) -> EricConnectorSettings:
        urls = extra.get("eric_urls", [])
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u]
        if not urls:
            raise ValueError('EricECConnector needs ec_connector_extra_config {"eric_urls": ["http://host:port"]}')
        backends = tuple(extra.get("backends", BACKENDS))
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown Eric transfer backends {sorted(unknown)}; choose from {BACKENDS}")
        return cls(tuple(u.rstrip("/") for u in urls), backends, float(extra.get("lookup_timeout_s", 2.0)),
                   environ.get(API_KEY_ENV) or None)


class EricECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if not self.is_consumer or self.is_producer:
            raise ValueError("EricECConnector is a consumer: use ec_role 'ec_consumer' (Eric is the producer)")
        assert vllm_config.ec_transfer_config is not None
        self._settings = EricConnectorSettings.parse(vllm_config.ec_transfer_config.ec_connector_extra_config)
        self._stats = EricECStats()
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        if role == ECConnectorRole.SCHEDULER:
            self._width = model_embedding_width(vllm_config.model_config)
            self._leases = LeaseClient(self._settings.api_key, self._settings.lookup_timeout_s)
            self._offers: dict[str, dict[str, EmbeddingHandle]] = {}  # request id -> its items' handles
            self._available: dict[str, dict[str, EmbeddingHandle]] = {}  # hash -> request id -> unused handle
            self._pending: list[EricLoad] = []
            self._unavailable: set[str] = set()
            self._scheduled: set[str] = set()  # identifiers whose load went to the workers
            self._loaded_for: dict[str, set[str]] = {}  # request id -> identifiers loaded with its own handles
        else:
            self._fetcher = EmbeddingFetcher(self._settings.backends, api_key=self._settings.api_key)
            self._dtype = vllm_config.model_config.dtype
            self._failed: set[str] = set()

    # ---- scheduler side --------------------------------------------------------------------------------------

    def _offers_of(self, request: Request, live: bool = True) -> dict[str, EmbeddingHandle]:
        """The request's own handles (parsed and checked once); a live request with a bad handle is failed."""
        rid = request.request_id
        if rid in self._offers:
            return self._offers[rid]
        params = getattr(request, "sampling_params", None)
        try:
            offered = offered_handles(getattr(params, "extra_args", None), self._settings.eric_urls, self._width)
        except HandleError as e:
            logger.warning("request %s: refused Eric handles: %s", rid, e)
            if live:
                self._unavailable.add(rid)
                self._stats.record(unavailable_requests=1)
            offered = {}
        wanted = {f.identifier for f in request.mm_features}
        offers = self._offers[rid] = {k: h for k, h in offered.items() if k in wanted}
        for key, handle in offers.items():
            self._available.setdefault(key, {})[rid] = handle
        return offers

    def _take(self, key: str, rid: str) -> EmbeddingHandle | None:
        """The request's own unused handle for `key`, else another live request's; removed from the available."""
        holders = self._available.get(key)
        if not holders:
            return None
        handle = holders.pop(rid, None) if rid in holders else holders.pop(next(iter(holders)))
        if not holders:
            del self._available[key]
        return handle

    def has_cache_item(self, identifier: str) -> bool:
        return bool(self._available.get(identifier))

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Hold back (and later fail) a request whose item is neither offered by an Eric handle nor present as raw
        media, or whose handles failed their checks."""
        offers = self._offers_of(request)
        if request.request_id in self._unavailable:
            return False
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens or feature.identifier in self._scheduled:
                continue  # already in the KV cache, or its load is already scheduled
            own = offers.get(feature.identifier)
            if own is not None and own.shape[0] != request.get_num_encoder_embeds(index):
                logger.warning("request %s: embedding %s has %d rows, its grid needs %d", request.request_id,
                               feature.identifier[:16], own.shape[0], request.get_num_encoder_embeds(index))
                self._unavailable.add(request.request_id)
                self._stats.record(unavailable_requests=1)
                return False
            if feature.identifier not in offers and not self.has_cache_item(feature.identifier) \
                    and not has_raw_media(feature):
                logger.warning("request %s: item %s has no Eric handle and carries no media to encode locally",
                               request.request_id, feature.identifier)
                self._unavailable.add(request.request_id)
                self._stats.record(unavailable_requests=1)
                return False
        return True

    def take_unavailable_requests(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        return taken

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        rid = request.request_id
        own = feature.identifier in self._offers_of(request)
        handle = self._take(feature.identifier, rid)
        if handle is None:
            return
        leases = [handle.lease]
        if self._tp_size > 1:  # every TP rank reads and acknowledges its own lease
            leases += self._leases.add_children(handle, self._tp_size - 1)
            if len(leases) < self._tp_size:
                self._unavailable.add(rid)  # the load still runs (the step stays well-formed); the request fails
                leases += [handle.lease] * (self._tp_size - len(leases))
        self._pending.append(EricLoad(rid, feature.identifier, request.get_num_encoder_embeds(index),
                                      msgspec.to_builtins(handle), leases))
        if own:
            self._loaded_for.setdefault(rid, set()).add(feature.identifier)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        local = sum(len(v) for v in scheduler_output.scheduled_encoder_inputs.values())
        self._stats.record(local_encoder_items=local, external_items=len(self._pending))
        meta, self._pending = EricECMetadata(self._pending), []
        for load in meta.loads:
            self._scheduled.add(load.mm_hash)
        return meta

    def update_state_after_free(self, request: Request, index: int) -> None:
        """vLLM dropped the item from its encoder cache: a later use must load it again."""
        self._scheduled.discard(request.mm_features[index].identifier)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, EricWorkerMetadata):
            self._unavailable |= meta.failed_request_ids
            self._stats.record(**meta.counts)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Eric items of this request that were never loaded with its own leases (vLLM already had them cached, or
        the request ended first) still hold the leases its encode took: give them back now, not at the TTL."""
        rid = request.request_id
        offers = self._offers_of(request, live=False)  # also a request that ended before it was ever scheduled
        del self._offers[rid]
        for key in offers:
            holders = self._available.get(key)
            if holders is not None and holders.pop(rid, None) is not None and not holders:
                del self._available[key]
        loaded = self._loaded_for.pop(rid, set())
        unused = [h for key, h in offers.items() if key not in loaded]
        if unused:
            self._leases.release(unused)
            self._stats.record(released_items=len(unused))
        return False, None

    # ---- worker side -----------------------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, EricECMetadata)
        for load in meta.loads:
            if load.mm_hash not in encoder_cache:
                encoder_cache[load.mm_hash] = self._load(load)

    def _load(self, load: EricLoad) -> torch.Tensor:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        rank = get_tensor_model_parallel_rank() if self._tp_size > 1 else 0
        handle = msgspec.structs.replace(as_handle(load.handle), lease=load.leases[rank % len(load.leases)])
        device = torch.device(current_platform.device_type)
        if current_platform.is_cuda_alike():
            device = torch.device(device.type, current_platform.current_device())
        try:
            if handle.shape[0] != load.num_tokens:  # checked before any byte moves
                raise TransferError(f"embedding has {handle.shape[0]} rows, the prompt has {load.num_tokens} slots")
            tensor = self._fetcher.fetch(handle)
        except TransferError as e:
            logger.error("request %s: cannot fetch embedding %s: %s", load.request_id, load.mm_hash, e)
            self._failed.add(load.request_id)
            self._stats.record(load_failures=1)
            # keep this step well-formed; the scheduler fails the request before it returns any output
            return torch.zeros(load.num_tokens, handle.shape[-1], dtype=self._dtype, device=device)
        self._stats.record(loaded_items=1, loaded_bytes=handle.nbytes)
        return tensor.to(device=device, dtype=self._dtype, non_blocking=False)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Consumer only: nothing to save."""

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if not self._failed and self._stats.is_empty():
            return None
        meta = EricWorkerMetadata(self._failed, self._stats.data)
        self._failed, self._stats = set(), EricECStats()
        return meta

    # ---- both ------------------------------------------------------------------------------------------------

    def get_ec_connector_stats(self) -> EricECStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, EricECStats()
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> EricECStats:
        return EricECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]):  # -> EricECPromMetrics
        from eric_epd.plugins.vllm.stats import EricECPromMetrics

        return EricECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.role == ECConnectorRole.WORKER:
            self._fetcher.close()
        else:
            self._leases.close()
