"""Faults at the vLLM connector's scheduler side, driven as vLLM drives it (real producer process, two ranks): an
image whose landing timed out is served again with a fresh lease (and to a request that had joined that fetch, with
its own), the connector follows vLLM's encoder cache through a reset and an eviction, handles no item takes, or
the valid ones of a refused set, go back at once, and an item a rank has no copy of fails every request using it and
leaves vLLM's encoder cache."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import msgspec
import pytest
import torch
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

from eric_epd.plugins.vllm.connector import EricECConnector, EricWorkerMetadata
from eric_epd.plugins.vllm.encoder_cache import VllmEncoderCache
from eric_epd.plugins.vllm.landing import LandingAddress
from eric_epd.testing.stack import wait_for
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.wire.handles import EmbeddingHandle
from eric_epd.wire.handoff import handles_xargs
from tests.support import helpers_landing
from tests.support.helpers_landing import ITEM, WIDTH, landing_idle, pool_entries, pool_entry, ranks, stalled

producer = helpers_landing.producer  # the module's producer process (a module-scoped fixture)


def _connector(producer, address: LandingAddress) -> EricECConnector:
    """The connector's scheduler side as vLLM builds it, for a model whose rows are WIDTH wide."""
    extra = {"eric_urls": [producer.url], "backends": ["http"], "fetch_timeout_s": 0.5, "staging_bytes": 1 << 20}
    config = SimpleNamespace(
        ec_transfer_config=ECTransferConfig(
            ec_connector="EricECConnector", ec_role="ec_consumer", ec_connector_extra_config=extra
        ),
        parallel_config=SimpleNamespace(data_parallel_index=address.dp_index, tensor_parallel_size=2),
        instance_id=address.instance,
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(
                to_dict=lambda: {"model_type": "qwen2_vl", "vision_config": {"hidden_size": WIDTH}}
            )
        ),
    )
    return EricECConnector(config, ECConnectorRole.SCHEDULER)  # type: ignore[arg-type]


def _request(rid: str, handle: EmbeddingHandle) -> Request:
    """An EPD request as the gateway sends it: one metadata-only image item, its handle beside it."""
    rows = handle.shape[0]
    feature = MultiModalFeatureSpec(
        data={"image_grid_thw": None},
        modality="image",  # type: ignore[arg-type]
        identifier=handle.hash,
        mm_position=PlaceholderRange(offset=1, length=rows),
    )
    return Request(
        rid, [0] * (rows + 2), SamplingParams(extra_args=handles_xargs([handle])), None, mm_features=[feature]
    )


def _load_on_every_rank(connector: EricECConnector, request: Request, areas: list, rows: torch.Tensor) -> None:
    """The request's one staged item goes to the workers in a step: every rank's copy holds `rows`; the workers
    then report it copied."""
    key = request.mm_features[0].identifier
    connector.update_state_after_alloc(request, 0)
    meta = connector.build_connector_meta(
        SimpleNamespace(  # type: ignore[arg-type]
            scheduled_encoder_inputs={}, free_encoder_mm_hashes=[], total_num_scheduled_tokens=1
        )
    )
    (load,) = meta.loads  # type: ignore[attr-defined]
    assert load.request_id == request.request_id and load.staged is not None
    for area in areas:
        assert torch.equal(area.take(load.staged.offset, key), rows)
    connector.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=EricWorkerMetadata(copied={key})))


def test_connector_serves_an_image_again_after_its_landing_timed_out(producer) -> None:
    """The scheduler side of the connector: the request whose landing timed out fails; the same image then comes
    with a fresh lease, lands, and goes to the workers with the right values."""
    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    first, fresh = pool_entry(producer, "connector-image", seed=0, data=rows)
    address = LandingAddress(f"conn{uuid.uuid4().hex[:8]}")
    with ranks(address, 1 << 20, torch.float32) as areas:
        connector = _connector(producer, address)
        try:
            r1 = _request("r1", first)
            with stalled(producer):  # the ranks' reads hang past the landing timeout (2 x 0.5 + 5 s)
                assert wait_for(
                    lambda: (
                        not connector.ensure_cache_available(r1, 0) and "r1" in connector.take_unavailable_requests()
                    ),
                    60,
                    0.1,
                )
            connector.request_finished(r1)
            r2 = _request("r2", fresh)
            assert wait_for(lambda: connector.ensure_cache_available(r2, 0), 60, 0.1)
            assert connector.has_cache_item(fresh.hash)
            _load_on_every_rank(connector, r2, areas, rows)
            connector.request_finished(r2)
            assert not connector.take_unavailable_requests()
            assert landing_idle(connector.scheduler._prefetch, areas)
        finally:
            connector.shutdown()
    assert wait_for(lambda: pool_entries(producer) == 0, 30)


def test_a_request_that_joined_a_failed_fetch_is_served_with_its_own_lease(producer) -> None:
    """r2 wants the image r1 is fetching, and joins that fetch; r1's landing times out: r2 does not fail with it,
    but fetches the image again with its own lease (before, both failed)."""
    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    first, own = pool_entry(producer, "joined-image", seed=1, data=rows)
    address = LandingAddress(f"conn{uuid.uuid4().hex[:8]}")
    with ranks(address, 1 << 20, torch.float32) as areas:
        connector = _connector(producer, address)
        try:
            r1, r2 = _request("r1", first), _request("r2", own)
            with stalled(producer):  # r1's fetch hangs past the landing timeout; r2 joins it meanwhile
                assert not connector.ensure_cache_available(r1, 0) and not connector.ensure_cache_available(r2, 0)
                assert wait_for(
                    lambda: (
                        not connector.ensure_cache_available(r1, 0) and "r1" in connector.take_unavailable_requests()
                    ),
                    60,
                    0.1,
                )
            assert wait_for(lambda: connector.ensure_cache_available(r2, 0), 60, 0.1)
            assert not connector.take_unavailable_requests()  # r2 was never failed
            _load_on_every_rank(connector, r2, areas, rows)
            connector.request_finished(r1)
            connector.request_finished(r2)
            assert landing_idle(connector.scheduler._prefetch, areas)
        finally:
            connector.shutdown()
    assert wait_for(lambda: pool_entries(producer) == 0, 30)


def test_connector_follows_vllms_encoder_cache_through_reset_and_eviction(producer) -> None:
    """The connector reads vLLM's own encoder cache manager (no copy of its own): an item vLLM holds is not fetched;
    one vLLM evicts in the very pass that needs it is still a load (the workers keep its rows), never a failure;
    after vLLM resets the cache the next request fetches the item again and loads its real rows."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    h1, h2, h3 = pool_entry(producer, "reset-image", seed=0, leases=3, data=rows)
    n = rows.shape[0]
    manager = EncoderCacheManager(cache_size=n)
    address = LandingAddress(f"conn{uuid.uuid4().hex[:8]}")
    step = SimpleNamespace(scheduled_encoder_inputs={}, free_encoder_mm_hashes=[], total_num_scheduled_tokens=1)
    with ranks(address, 1 << 20, torch.float32) as areas:
        connector = _connector(producer, address)
        connector.scheduler._vllm_cache = VllmEncoderCache(SimpleNamespace(encoder_cache_manager=manager))

        def scheduled(request: Request) -> int:
            """vLLM's pass for a request whose item its cache lacks: a load, allocated, sent to the workers; the
            number of loads (each with the real rows on every rank)."""
            assert connector.has_cache_item(h1.hash) and manager.can_allocate(request, 0, n, 0)
            manager.allocate(request, 0)
            connector.update_state_after_alloc(request, 0)
            loads = connector.build_connector_meta(step).loads  # type: ignore[arg-type, attr-defined]
            for ld in loads:
                assert all(torch.equal(area.take(ld.staged.offset, ld.mm_hash), rows) for area in areas)
            connector.update_connector_output(
                ECConnectorOutput(ec_connector_worker_meta=EricWorkerMetadata(copied={ld.mm_hash for ld in loads}))
            )
            return len(loads)

        def finished(request: Request) -> None:
            connector.request_finished(request)
            manager.free(request)

        try:
            r1, r2, r3 = (_request(f"r{i}", h) for i, h in enumerate((h1, h2, h3), 1))
            assert wait_for(lambda: connector.ensure_cache_available(r1, 0), 60, 0.1)
            assert scheduled(r1) == 1
            finished(r1)
            assert connector.ensure_cache_available(r2, 0)  # vLLM holds it: nothing fetched, ...
            assert connector.scheduler._prefetch.get(h1.hash) is None
            assert manager.can_allocate(SimpleNamespace(get_num_encoder_embeds=lambda i: n), 0, n, 0)  # ... evicted
            assert scheduled(r2) == 0  # in this pass: vLLM allocates it again, its rows stay on the workers
            finished(r2)
            assert not connector.has_cache_item(h1.hash)  # the pass is over
            manager.reset()
            assert wait_for(lambda: connector.ensure_cache_available(r3, 0), 60, 0.1)  # fetched with r3's lease
            assert scheduled(r3) == 1
            finished(r3)
            assert not connector.take_unavailable_requests()
            assert connector.get_ec_connector_stats().data == {  # type: ignore[union-attr]
                "loaded_items": 2,
                "loaded_bytes": 2 * ITEM,
                "via_http": 2,
                "external_items": 2,
                "released_items": 1,
            }
            assert landing_idle(connector.scheduler._prefetch, areas)
        finally:
            connector.shutdown()
    assert wait_for(lambda: pool_entries(producer) == 0, 30)


def test_a_preempted_request_fetches_its_evicted_item_again_with_the_kept_lease(producer) -> None:
    """vLLM preempts a request after its item was loaded (its encoder inputs freed) and evicts the item for another
    one; resumed, the request fetches the item again, twice over, though its own lease went at the first fetch: with
    the child lease Eric answered each acknowledgement with. Every load lands the real rows; the kept lease holds the
    entry while the request lives and goes back when it ends. Before, the resumed request failed (no Eric handle)."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    (handle,) = pool_entry(producer, "preempted-image", seed=6, leases=1, data=rows)
    n = rows.shape[0]
    manager = EncoderCacheManager(cache_size=n)
    other = SimpleNamespace(get_num_encoder_embeds=lambda i: n)  # another request's item of the cache's size
    address = LandingAddress(f"conn{uuid.uuid4().hex[:8]}")
    with ranks(address, 1 << 20, torch.float32) as areas:
        connector = _connector(producer, address)
        connector.scheduler._vllm_cache = VllmEncoderCache(SimpleNamespace(encoder_cache_manager=manager))
        try:
            r1 = _request("r1", handle)
            for _ in range(3):  # the first schedule, then two resumes after preemption and eviction
                assert wait_for(lambda: connector.ensure_cache_available(r1, 0), 60, 0.1)
                assert not connector.take_unavailable_requests()
                manager.allocate(r1, 0)
                _load_on_every_rank(connector, r1, areas, rows)
                assert wait_for(lambda: pool_entries(producer) == 1, 30)  # held by the kept lease alone
                manager.free(r1)  # preempted: vLLM frees the request's encoder inputs ...
                assert manager.can_allocate(other, 0, n, 0)  # ... and evicts its item for another's
                assert manager.get_cached_num_encoder_embeds(r1, 0) is None
            connector.request_finished(r1)
            assert landing_idle(connector.scheduler._prefetch, areas)
        finally:
            connector.shutdown()
    assert wait_for(lambda: pool_entries(producer) == 0, 30)
    acks = EmbeddingFetcher(("http",))
    try:
        with pytest.raises(TransferError, match="no longer valid"):  # the request's own lease ended at the first fetch
            acks.ack(handle)
    finally:
        acks.close()


def test_handles_no_item_takes_go_back_at_once_and_a_refused_set_returns_its_valid_ones(producer) -> None:
    """A handle none of the request's items names (an item vLLM renamed, or a stray) goes back as soon as the
    connector reads the request, not at its lease's TTL; a request whose handles are refused as a whole (one names
    a producer not configured) fails, and its valid handles go back too (the stranger is never contacted)."""
    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    (used,) = pool_entry(producer, "offer-used", seed=1, leases=1, data=rows)
    (stray,) = pool_entry(producer, "offer-stray", seed=2, leases=1, data=rows)
    address = LandingAddress(f"offer{uuid.uuid4().hex[:8]}")
    connector = _connector(producer, address)
    try:
        r1 = _request("r1", used)
        r1.sampling_params.extra_args = handles_xargs([used, stray])
        assert set(connector.scheduler._offers_of(r1) or {}) == {used.hash}
        assert wait_for(lambda: pool_entries(producer) == 1, 30)  # the stray's lease acked, the used one still held
        connector.request_finished(r1)
        assert wait_for(lambda: pool_entries(producer) == 0, 30)

        (valid,) = pool_entry(producer, "offer-valid", seed=3, leases=1, data=rows)
        stranger = msgspec.structs.replace(
            valid,
            hash="offer-stranger",
            producer="http://127.0.0.1:9",
            http="http://127.0.0.1:9/v1/embeddings/offer-stranger",
        )
        r2 = _request("r2", valid)
        r2.sampling_params.extra_args = handles_xargs([valid, stranger])
        assert not connector.scheduler._offers_of(r2)
        assert "r2" in connector.take_unavailable_requests()
        assert wait_for(lambda: pool_entries(producer) == 0, 30)  # the valid handle's lease came back at once
        connector.request_finished(r2)
    finally:
        connector.shutdown()


def test_an_item_a_rank_has_no_copy_of_fails_its_users_and_leaves_vllms_cache(producer, monkeypatch) -> None:
    """A step loads an item that one rank has no landed copy of ("cannot happen": a rank without one fails the
    landing): that rank puts zeros in vLLM's encoder cache to keep the step well-formed. Every request that computed
    with the item then fails (not only the one that loaded it: r2 got it from vLLM's cache in the same pass, and
    vLLM let go of it for both once their spans were computed, before the connector heard of the step), while r4,
    which has not reached it, goes on; vLLM's encoder cache manager drops the item (its room back, the workers told
    to free it), so no later request is served those zeros; the next load replaces them with the real rows. Before,
    r2 was served and the zeros stayed cached."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    from eric_epd.plugins.vllm import worker_side
    from eric_epd.plugins.vllm.settings import EricConnectorSettings

    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    h1, h2, h3, h4 = pool_entry(producer, "unlanded-image", seed=7, leases=4, data=rows)
    n = rows.shape[0]
    manager = EncoderCacheManager(cache_size=2 * n)
    address = LandingAddress(f"conn{uuid.uuid4().hex[:8]}")
    step = SimpleNamespace(scheduled_encoder_inputs={}, free_encoder_mm_hashes=[], total_num_scheduled_tokens=1)
    settings = EricConnectorSettings.parse({"eric_urls": [producer.url], "backends": ["http"]})
    with ranks(address, 1 << 20, torch.float32) as areas, ranks(LandingAddress("never-ordered"), 1 << 20) as empty:
        workers = []
        for area in (areas[0], empty[1]):  # rank 1's worker reads an area no copy ever lands in
            monkeypatch.setattr(worker_side, "_landing_area", lambda *_, a=area: a)
            workers.append(worker_side.EricWorker(settings, address, torch.float32))
        caches: list[dict[str, torch.Tensor]] = [{}, {}]
        connector = _connector(producer, address)
        live: dict[str, Request] = {}  # vLLM's scheduler.requests
        scheduler = SimpleNamespace(encoder_cache_manager=manager, requests=live)
        connector.scheduler._vllm_cache = VllmEncoderCache(scheduler)

        def step_on_workers(*computed: Request) -> None:
            """A step: the loads land in each rank's encoder cache, the `computed` requests compute their prompts
            (and vLLM lets go of their items), then the workers' metadata reaches the connector."""
            meta = connector.build_connector_meta(step)  # type: ignore[arg-type]
            for worker, cache in zip(workers, caches, strict=True):
                worker.start_load_caches(meta, cache)  # type: ignore[arg-type]
            for request in computed:
                request.num_computed_tokens = request.num_prompt_tokens
                manager.free_encoder_input(request, 0)
            worker_meta = workers[0].build_connector_worker_meta()
            other = workers[1].build_connector_worker_meta()
            assert worker_meta is not None and other is not None
            connector.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker_meta.aggregate(other)))

        try:
            r1, r2, r3, r4 = (_request(f"r{i}", h) for i, h in enumerate((h1, h2, h3, h4), 1))
            live.update({"r1": r1, "r2": r2, "r4": r4})
            assert wait_for(lambda: connector.ensure_cache_available(r1, 0), 60, 0.1)
            manager.allocate(r1, 0)
            connector.update_state_after_alloc(r1, 0)
            assert manager.check_and_update_cache(r2, 0)  # r2 uses it from vLLM's cache in the same pass
            step_on_workers(r1, r2)
            assert torch.equal(caches[0][h1.hash], rows) and not caches[1][h1.hash].any()  # zeros on rank 1
            assert connector.take_unavailable_requests() == {"r1", "r2"}  # not r4
            assert manager.get_cached_num_encoder_embeds(r3, 0) is None and h1.hash in manager.get_freed_mm_hashes()
            for request in (r1, r2, r4):
                connector.request_finished(request)
                manager.free(request)
                del live[request.request_id]
            assert manager.num_free_slots == manager.num_freeable_slots == 2 * n and not manager.freeable
            # vLLM allocates the item again before its workers freed it: the load replaces the zeros
            workers[1]._area = areas[1]
            assert wait_for(lambda: connector.ensure_cache_available(r3, 0), 60, 0.1)
            manager.allocate(r3, 0)
            connector.update_state_after_alloc(r3, 0)
            step_on_workers(r3)
            assert all(torch.equal(cache[h1.hash], rows) for cache in caches)
            assert not connector.take_unavailable_requests()
            connector.request_finished(r3)
            manager.free(r3)
            assert landing_idle(connector.scheduler._prefetch, areas)
        finally:
            connector.shutdown()
            for worker in workers:
                worker.close()
    assert wait_for(lambda: pool_entries(producer) == 0, 30)
