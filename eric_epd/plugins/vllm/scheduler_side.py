"""The connector's scheduler side (EngineCore process): each request brings the handles (with lease tokens) of its
Eric items beside it, in `sampling_params.extra_args` (the gateway writes them); they are checked (a configured Eric:
in `eric_urls`, or an address of an `eric_dns` name, trust.py; the model's embedding width, a consistent byte
length). The request waits (`ensure_cache_available` is False) while every worker lands its items in its own device
memory in the background and the scheduler then acknowledges them to Eric (or while a producer awaits a fresh lookup
of the `eric_dns` names); no network call runs on the scheduler's loop or in a model step, and a slow Eric delays only
the requests whose items it holds. A request whose items can be neither fetched nor encoded locally, or whose handles
fail the checks, is failed alone; a failed fetch leaves nothing behind: the next request for that item fetches it
again with its own lease. A preempted request whose item vLLM evicted fetches it again with the lease kept for it
(kept.py). Whether vLLM's encoder cache holds an item is read from vLLM's scheduler itself
(encoder_cache.py), so after vLLM resets that cache the next request fetches its items again."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from eric_epd.plugins.vllm.aliases import audio_in_video_offers
from eric_epd.plugins.vllm.encoder_cache import VllmEncoderCache, building_scheduler
from eric_epd.plugins.vllm.kept import KeptLeases
from eric_epd.plugins.vllm.landing import LandingAddress, LandingChannel
from eric_epd.plugins.vllm.leases import LeaseClient, has_raw_media
from eric_epd.plugins.vllm.settings import EricConnectorSettings
from eric_epd.plugins.vllm.staging import Prefetcher, Staged, State
from eric_epd.plugins.vllm.stats import EricECStats
from eric_epd.plugins.vllm.step_meta import EricECMetadata, EricLoad, EricWorkerMetadata
from eric_epd.plugins.vllm.trust import TrustedProducers
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.wire.handles import EmbeddingHandle
from eric_epd.wire.handoff import (
    HandleError,
    model_embedding_widths,
    offered_handles,
    offered_producers,
    offered_soundtracks,
    returnable_handles,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.002
"""With nothing to run but requests waiting for their fetches, the scheduler waits this long for one to end."""


class EricScheduler:
    """The scheduler's half of the connector: requests' offers, their prefetches, and their leases' ends."""

    def __init__(self, vllm_config: VllmConfig, settings: EricConnectorSettings, address: LandingAddress) -> None:
        model = vllm_config.model_config
        self._widths = model_embedding_widths(model)  # by modality
        mm_config = getattr(model, "multimodal_config", None)
        self._hashing = (getattr(mm_config, "mm_hasher_algorithm", "blake3"), str(getattr(model, "model", "")))
        """How vLLM's processor hashes items (algorithm, model id): what aliases.py names them by."""
        self._trust = TrustedProducers(settings.eric_urls, settings.eric_dns, settings.dns_interval_s)
        acks = EmbeddingFetcher(settings.backends, settings.fetch_timeout_s, settings.api_key, settings.mooncake)
        self._leases = LeaseClient(acks)  # the one client every acknowledgement of this side goes through
        self._kept = KeptLeases(self._leases)  # a lease per loaded item, to fetch it again after a preemption
        self._prefetch = Prefetcher(
            LandingChannel(address, vllm_config.parallel_config.tensor_parallel_size),
            acks,
            settings.staging_bytes,
            settings.prefetch_threads,
            land_timeout_s=2 * settings.fetch_timeout_s + 5,
        )
        self._offers: dict[str, dict[str, EmbeddingHandle]] = {}  # request id -> its items' handles
        self._available: dict[str, dict[str, EmbeddingHandle]] = {}  # hash -> request id -> unused handle
        self._used: dict[str, set[str]] = {}  # request id -> hashes fetched with its own lease
        self._pending: list[EricLoad] = []
        self._unavailable: set[str] = set()
        # vLLM hands its connector no view of its encoder cache, whose evictions decide what must be fetched again:
        # the scheduler building this connector is found up the call stack instead (encoder_cache.py)
        self._vllm_cache = VllmEncoderCache(building_scheduler())
        self.stats = EricECStats()
        """Counters since vLLM last collected them."""

    def _offers_of(self, request: Request, live: bool = True) -> dict[str, EmbeddingHandle] | None:
        """The request's own handles (parsed and checked once); a live request with a bad handle is failed. None
        while a producer may be an Eric that just joined an eric_dns name (a lookup is under way)."""
        rid = request.request_id
        if rid in self._offers:
            return self._offers[rid]
        extra_args = getattr(getattr(request, "sampling_params", None), "extra_args", None)
        if live and self._trust.by_name and not self._trust.settled(offered_producers(extra_args)):
            return None
        widths = set(self._widths.values())
        try:
            offered = offered_handles(extra_args, self._trust, widths)
            soundtracks = offered_soundtracks(extra_args, offered)
            if soundtracks:  # a use_audio_in_video request: vLLM names its items after their uuids and the option
                offered = audio_in_video_offers(offered, soundtracks, *self._hashing)
            given = list(offered.values())
        except HandleError as e:
            if live:
                self._fail(rid, f"refused Eric handles: {e}")
            offered, given = {}, returnable_handles(extra_args, self._trust, widths)
        wanted = {f.identifier for f in request.mm_features}
        offers = self._offers[rid] = {k: h for k, h in offered.items() if k in wanted}
        for key, handle in offers.items():
            self._available.setdefault(key, {})[rid] = handle
        kept = {h.lease for h in offers.values()}
        stray = list({h.lease: h for h in given if h.lease not in kept}.values())
        if stray:  # no item of this request will ever take them: back now, not at their TTL
            self._leases.release(stray)
            self.stats.record(released_items=len(stray))
        return offers

    def _fail(self, rid: str, why: str) -> bool:
        logger.warning("request %s: %s", rid, why)
        if rid not in self._unavailable:
            self._unavailable.add(rid)
            self.stats.record(unavailable_requests=1)
        return False

    def _offer(self, key: str, rid: str) -> EmbeddingHandle | None:
        """The request's own unused handle for `key`, else another live request's."""
        holders = self._available.get(key) or {}
        return holders.get(rid) or next(iter(holders.values()), None)

    def _spend(self, key: str, handle: EmbeddingHandle) -> None:
        """A fetch took `handle`'s lease: it is no longer offered, nor given back when its request ends."""
        holders = self._available.get(key, {})
        owner = next((r for r, h in holders.items() if h is handle), None)
        if owner is not None:
            del holders[owner]
            if not holders:
                del self._available[key]
            self._used.setdefault(owner, set()).add(key)

    def has_cache_item(self, identifier: str) -> bool:
        """Asked only of an item vLLM's encoder cache does not hold now. True (vLLM then schedules a load, never its
        own encoder) if it is staged, or if vLLM held it earlier in this pass (the workers still have its rows)."""
        return self._prefetch.ready(identifier) or self._vllm_cache.held_this_pass(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """True once every Eric item the request still needs is staged; until then its fetches run in the
        background and it waits. Fails a request whose item is at no Eric and carries no media to encode locally,
        whose handles failed their checks, or whose fetch failed."""
        offers = self._offers_of(request)
        rid = request.request_id
        if offers is None or rid in self._unavailable:
            return False
        needed: list[int] = []
        starts: dict[int, EmbeddingHandle] = {}  # items whose fetch this request starts, with the lease it spends
        for index, feature in enumerate(request.mm_features):
            key, pos = feature.identifier, feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens or self._vllm_cache.holds(request, index):
                continue  # already in the KV cache, or in vLLM's encoder cache
            item = self._prefetch.get(key)
            if item is None or rid not in item.users:  # a failed item is fetched anew, with an unused lease
                fresh = item is None or item.state is State.FAILED
                handle = self._offer(key, rid) if fresh else offers.get(key) or item.handle
                if handle is None and has_raw_media(feature):
                    continue  # vLLM encodes it itself
                if handle is None and fresh:  # the lease kept since it was loaded (kept.py): it may have lapsed
                    handle = self._kept.handle(key)
                if handle is None:
                    return self._fail(rid, f"item {key[:16]} has no Eric handle and carries no media to encode")
                starts[index] = handle
            elif item.state is State.FAILED and (own := self._available.get(key, {}).get(rid)) is not None:
                self._prefetch.drop(key, rid)  # it joined another request's fetch, which failed: its own lease now
                starts[index] = own
            needed.append(index)
        try:  # its fetches start all or none
            wants = [(request.mm_features[i].identifier, h) for i, h in starts.items()]
            if wants and not self._prefetch.fits(rid, wants):
                return False
        except TransferError as e:
            return self._fail(rid, str(e))
        ready = True
        for index in needed:
            key = request.mm_features[index].identifier
            item = self._start(request, index, starts[index]) if index in starts else self._prefetch.get(key)
            if item is None:  # no room in the staging area now
                ready = False
                continue
            if item is False:
                return False
            if item.state is State.FAILED:
                self.stats.record(load_failures=1)
                return self._fail(rid, f"cannot fetch embedding {key[:16]}: {item.error}")
            ready = ready and item.state is State.READY
        return ready

    def _start(self, request: Request, index: int, handle: EmbeddingHandle) -> Staged | Literal[False] | None:
        """The staged item for the request's item at `index`, fetched with `handle` unless already here; None when
        the staging area has no room now, False once the request is failed (a handle of another shape)."""
        rid, feature = request.request_id, request.mm_features[index]
        key, rows = feature.identifier, request.get_num_encoder_embeds(index)
        if handle.shape[0] != rows:
            return self._fail(rid, f"embedding {key[:16]} has {handle.shape[0]} rows, its grid needs {rows}")
        width = self._widths.get(feature.modality, handle.shape[1])
        if handle.shape[1] != width:
            return self._fail(
                rid, f"embedding {key[:16]} has rows of {handle.shape[1]}; its {feature.modality} rows are {width} wide"
            )
        try:
            item = self._prefetch.want(key, handle, rid)
        except TransferError as e:
            return self._fail(rid, str(e))
        if item is not None and item.handle is handle:
            self._spend(key, handle)
            self._kept.spent(key, handle)
        return item

    def take_unavailable_requests(self) -> set[str]:
        """The requests failed since the last call (the scheduler fails them), forgotten here."""
        taken, self._unavailable = self._unavailable, set()
        return taken

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Queue the staged item at `index` for loading in this step."""
        key, rid = request.mm_features[index].identifier, request.request_id
        if not self._prefetch.ready(key):
            return  # vLLM's own encoder computes it, or the workers still hold it (`has_cache_item`)
        staged, backend = self._prefetch.to_workers(key, rid)
        child, names = self._prefetch.take_kept(key)
        self._kept.loaded(names, rid, child)
        self._pending.append(EricLoad(rid, key, staged))
        self.stats.record(loaded_items=1, loaded_bytes=staged.nbytes, **{f"via_{backend}": 1})

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EricECMetadata:
        """This step's loads for the workers; with nothing scheduled, wait briefly for a fetch or lookup."""
        local = sum(len(v) for v in scheduler_output.scheduled_encoder_inputs.values())
        self.stats.record(local_encoder_items=local, external_items=len(self._pending))
        meta, self._pending = EricECMetadata(self._pending), []
        self._vllm_cache.pass_ended()
        if not scheduler_output.total_num_scheduled_tokens and self._prefetch.busy():
            self._prefetch.wait(IDLE_WAIT_S)  # idle until a fetch ends, rather than spin the engine loop
        elif not scheduler_output.total_num_scheduled_tokens and self._trust.asking():
            time.sleep(IDLE_WAIT_S)  # a request waits for a lookup of the eric_dns names
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """Take in the workers' copies, failed requests and counters."""
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, EricWorkerMetadata):
            self._prefetch.copied(list(meta.copied))
            self._unavailable |= meta.failed_request_ids
            for key in meta.unlanded:  # zeros stand in on a rank: every request using them fails, and vLLM forgets it
                self._unavailable |= self._vllm_cache.evict(key)
            self.stats.record(**meta.counts)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Eric items of this request that were never fetched with its own leases (vLLM already had them cached,
        or the request ended first) still hold the leases its encode took: give them back now, not at the TTL."""
        rid = request.request_id
        offers = self._offers_of(request, live=False) or {}  # also one that ended before it was ever scheduled
        del self._offers[rid]
        for feature in request.mm_features:
            self._prefetch.drop(feature.identifier, rid)
        self._kept.ended(rid, [f.identifier for f in request.mm_features])
        for key in offers:
            holders = self._available.get(key)
            if holders is not None and holders.pop(rid, None) is not None and not holders:
                del self._available[key]
        used = self._used.pop(rid, set())
        spent = {offers[key].lease for key in used if key in offers}  # one lease may name two items (aliases)
        unused = list({h.lease: h for key, h in offers.items() if h.lease not in spent}.values())
        if unused:
            self._leases.release(unused)
            self.stats.record(released_items=len(unused))
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep the engine loop alive while fetches run (their requests may have ended meanwhile)."""
        return self._prefetch.busy()

    def close(self) -> None:
        """Close the lease client (its queued releases sent first), the prefetcher and its fetcher, the DNS lookups.
        Kept leases are left to their TTL (soft: they hold no room Eric needs)."""
        self._leases.close()
        self._prefetch.close()
        self._trust.close()
