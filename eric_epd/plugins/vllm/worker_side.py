"""The connector's worker side (each vLLM worker): lands items when told (NIXL READs straight into device memory),
copies each out in the model's dtype before the scheduler hears of it (a rank whose copy fails fails the item, never
a step), then hands those copies to vLLM's encoder cache."""

from __future__ import annotations

import logging

import torch

from eric_epd.plugins.vllm.landing import LandingAddress, LandingArea
from eric_epd.plugins.vllm.settings import EricConnectorSettings
from eric_epd.plugins.vllm.stats import EricECStats
from eric_epd.plugins.vllm.step_meta import EricECMetadata, EricLoad, EricWorkerMetadata
from eric_epd.transfer.client import EmbeddingFetcher

logger = logging.getLogger(__name__)


def _landing_area(settings: EricConnectorSettings, address: LandingAddress, dtype: torch.dtype) -> LandingArea:
    """This worker's landing area, on its own device, named by its tensor-parallel rank."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.platforms import current_platform

    device = torch.device(current_platform.device_type)
    if current_platform.is_cuda_alike():
        device = torch.device(device.type, current_platform.current_device())
    fetcher = EmbeddingFetcher(settings.backends, settings.fetch_timeout_s, settings.api_key, settings.mooncake)
    return LandingArea(
        address,
        get_tensor_model_parallel_rank(),
        settings.staging_bytes,
        device,
        fetcher,
        settings.prefetch_threads,
        dtype,
    )


class EricWorker:
    """One vLLM worker's half of the connector: its landing area, and the copies it hands to vLLM."""

    def __init__(self, settings: EricConnectorSettings, address: LandingAddress, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._area = _landing_area(settings, address, dtype)
        self._failed: set[str] = set()
        self._copied: set[str] = set()
        self._unlanded: set[str] = set()
        """Items zeros stood in for since the last step's metadata (the scheduler drops them from vLLM's cache)."""
        self._zeroed: set[str] = set()
        """Items whose entry in vLLM's encoder cache may still be zeros: a later load replaces it."""
        self.stats = EricECStats()
        """Counters since the last step's metadata (vLLM collects connector stats on the scheduler side only)."""

    def start_load_caches(self, meta: EricECMetadata, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Put each of this step's loads into vLLM's encoder cache, from this rank's landed copy."""
        for load in meta.loads:
            if load.mm_hash not in encoder_cache or load.mm_hash in self._zeroed:
                self._zeroed.discard(load.mm_hash)
                encoder_cache[load.mm_hash] = self._load(load)
            self._copied.add(load.mm_hash)

    def _load(self, load: EricLoad) -> torch.Tensor:
        """The copy this rank made when the item landed (nothing is allocated in a step, so nothing fails here)."""
        copy = self._area.take(load.staged.offset, load.staged.content or load.mm_hash)
        if copy is not None:
            if copy.is_cuda:  # made on the landing stream, used and freed on this one
                copy.record_stream(torch.cuda.current_stream(copy.device))
            return copy
        # cannot happen: a rank that has no copy fails the landing itself
        logger.error("request %s: no landed copy of embedding %s", load.request_id, load.mm_hash)
        self._failed.add(load.request_id)
        self._unlanded.add(load.mm_hash)
        self._zeroed.add(load.mm_hash)
        self.stats.record(load_failures=1)
        # keep this step well-formed; the scheduler then fails every request that uses the item and drops it from
        # vLLM's encoder cache, so no later request reads these zeros
        return torch.zeros(load.staged.shape, dtype=self._dtype, device=self._area.buffer.device)

    def build_connector_worker_meta(self) -> EricWorkerMetadata | None:
        """This rank's copies, failures and counters since the last step, or None when there are none."""
        unusable = self._area.take_unusable()
        if unusable:
            self.stats.record(unusable_transport=unusable)
        if not self._failed and not self._copied and not self._unlanded and self.stats.is_empty():
            return None
        meta = EricWorkerMetadata(self._failed, self._copied, self.stats.data, self._unlanded)
        self._failed, self._copied, self._unlanded, self.stats = set(), set(), set(), EricECStats()
        return meta

    def close(self) -> None:
        """Close the landing area."""
        self._area.close()
