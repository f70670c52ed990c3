"""Faults in the vLLM connector's landing leave nothing broken (real producer process, real ZMQ sockets, two ranks):
a landing that times out on a stalled Eric is fetched again by the next request with a fresh lease, its range, the
ranks' copies and the lease come back once every rank has answered, a request that finds no room waits only so long,
a rank whose copy fails fails the item and keeps nothing, the connector follows vLLM's encoder cache through a
reset and an eviction, and a consumer unmaps the pool of an Eric that restarted."""

from __future__ import annotations

import base64
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import msgspec
import numpy as np
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
from eric_epd.plugins.vllm.landing import LandingAddress, LandingArea, LandingChannel
from eric_epd.plugins.vllm.staging import Prefetcher, State
from eric_epd.testing.pool_server import seeded_bytes
from eric_epd.testing.server import PoolServer
from eric_epd.testing.stack import wait_for
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher, as_handle
from eric_epd.wire.handles import LEASE_HEADER, EmbeddingHandle
from eric_epd.wire.handoff import handles_xargs

ITEM = 256 << 10
WIDTH = 16


@pytest.fixture(scope="module")
def producer():
    with PoolServer(backends="shm", pool_bytes=16 << 20) as server:
        yield server


@contextmanager
def stalled(producer) -> Iterator[None]:
    """The producer stops answering (SIGSTOP) until the block ends."""
    os.kill(producer.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)


@contextmanager
def ranks(address: LandingAddress, nbytes: int, out_dtype: torch.dtype | None = None) -> Iterator[list[LandingArea]]:
    """Two workers' landing areas (CPU memory) reading over HTTP, so that a stalled producer stalls their reads."""
    areas = [
        LandingArea(
            address, r, nbytes, torch.device("cpu"), EmbeddingFetcher(("http",), http_timeout_s=300), 4, out_dtype
        )
        for r in range(2)
    ]
    try:
        yield areas
    finally:
        for area in areas:
            area.close()


@contextmanager
def landing(nbytes: int, room_timeout_s: float = 60.0) -> Iterator[tuple[Prefetcher, list[LandingArea]]]:
    address = LandingAddress(f"fault{uuid.uuid4().hex[:8]}")
    with ranks(address, nbytes) as areas:
        prefetch = Prefetcher(
            LandingChannel(address, 2),
            EmbeddingFetcher(("http",)),
            nbytes,
            4,
            land_timeout_s=1.0,
            room_timeout_s=room_timeout_s,
        )
        try:
            yield prefetch, areas
        finally:
            prefetch.close()


def _entry(producer, key: str, seed: int, leases: int = 2, data: torch.Tensor | None = None) -> list[EmbeddingHandle]:
    """A pool entry of seeded bytes (or `data`), and one handle per lease on it."""
    body: dict = {"hash": key, "nbytes": ITEM, "seed": seed, "leases": leases}
    if data is not None:
        body |= {
            "data": base64.b64encode(data.numpy().tobytes()).decode(),
            "shape": list(data.shape),
            "dtype": str(data.dtype).removeprefix("torch."),
        }
    resp = httpx.post(producer.url + "/v1/testing/entries", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    first = as_handle(resp.json())
    return [msgspec.structs.replace(first, lease=token) for token in resp.json()["leases"]]


def _entries(producer) -> int:
    return httpx.get(producer.url + "/v1/transfer", timeout=30).json()["entries"]


def _settled(prefetch: Prefetcher, key: str) -> State:
    assert wait_for(lambda: prefetch.get(key).state is not State.PENDING, 60, 0.05)  # type: ignore[union-attr]
    return prefetch.get(key).state  # type: ignore[union-attr]


def _idle(prefetch: Prefetcher, areas: list[LandingArea]) -> bool:
    """Every range free and every rank's copy dropped (late ranks answer, releases arrive, in their own time)."""
    return wait_for(lambda: prefetch.used_bytes() == 0 and all(a.copies() == 0 for a in areas), 60, 0.05)


def test_timed_out_landing_is_fetched_again_with_a_fresh_lease(producer) -> None:
    with landing(1 << 20) as (prefetch, areas):
        first, fresh = _entry(producer, "stalled-item", seed=11)
        with stalled(producer):
            failed = prefetch.want(first.hash, first, "r1")
            assert failed is not None and _settled(prefetch, first.hash) is State.FAILED
            assert "did not answer" in failed.error and failed.late == 1  # the ranks may still write there
        item = prefetch.want(fresh.hash, fresh, "r2")  # r1 has not even ended yet: r2 fetches anew
        assert item is not None and item is not failed and item.offset != failed.offset
        assert _settled(prefetch, fresh.hash) is State.READY
        load, _ = prefetch.to_workers(fresh.hash, "r2")
        for area in areas:
            assert np.array_equal(area.take(load.offset, fresh.hash).numpy(), seeded_bytes(ITEM, 11))
        prefetch.copied([fresh.hash])
        prefetch.drop(first.hash, "r1")  # the failed request ends: its range comes back once the ranks answered
        assert _idle(prefetch, areas)
        assert wait_for(lambda: _entries(producer) == 0, 30)  # r2 acknowledged; r1's lease given back
        assert failed.late == 0 and not failed.unacked


def test_repeated_timeouts_give_staging_space_back_and_room_waits_end(producer) -> None:
    keys = [f"repeat{i}" for i in range(3)]
    handles = {key: _entry(producer, key, seed=20 + i) for i, key in enumerate(keys)}
    extra = _entry(producer, "no-room", seed=29, leases=1)[0]
    with landing(3 * ITEM, room_timeout_s=0.5) as (prefetch, areas):
        assert prefetch.used_bytes() == 0
        with stalled(producer):
            for key in keys:
                assert prefetch.want(key, handles[key][0], f"first-{key}") is not None
            assert all(_settled(prefetch, key) is State.FAILED for key in keys)
            assert prefetch.used_bytes() == 3 * ITEM  # the late ranks may still write: nothing is reused yet
            assert prefetch.want(extra.hash, extra, "crowded") is None  # no room: wait for a later step...
            with pytest.raises(TransferError, match="no room"):  # ...but not for ever
                wait_for(lambda: prefetch.want(extra.hash, extra, "crowded") is not None, 30, 0.05)
        for key in keys:
            prefetch.drop(key, f"first-{key}")
        assert _idle(prefetch, areas)  # back to its starting free amount
        for i, key in enumerate(keys):
            assert prefetch.want(key, handles[key][1], f"again-{key}") is not None
            assert _settled(prefetch, key) is State.READY
            load, _ = prefetch.to_workers(key, f"again-{key}")
            for area in areas:
                assert np.array_equal(area.take(load.offset, key).numpy(), seeded_bytes(ITEM, 20 + i))
            prefetch.copied([key])
        assert _idle(prefetch, areas)
    httpx.post(
        f"{producer.url}/v1/embeddings/{extra.hash}/ack",
        headers={LEASE_HEADER: extra.lease},
        json={"instance_id": extra.instance_id},
        timeout=30,
    )
    assert wait_for(lambda: _entries(producer) == 0, 30)


def test_a_rank_whose_copy_fails_fails_the_item_and_keeps_nothing(producer) -> None:
    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    first, fresh = _entry(producer, "copy-fails", seed=0, data=rows)
    address = LandingAddress(f"copy{uuid.uuid4().hex[:8]}")
    with ranks(address, 1 << 20, torch.bfloat16) as areas:
        prefetch = Prefetcher(LandingChannel(address, 2), EmbeddingFetcher(("http",)), 1 << 20, 2, 30.0)
        copy, failures = areas[1].tensor, []

        def out_of_memory(*args: object) -> torch.Tensor:  # the device refuses rank 1's first copy
            if not failures:
                failures.append(args)
                raise RuntimeError("device out of memory")
            return copy(*args)  # type: ignore[arg-type]

        areas[1].tensor = out_of_memory  # type: ignore[method-assign]
        try:
            failed = prefetch.want(first.hash, first, "r1")
            assert failed is not None and _settled(prefetch, first.hash) is State.FAILED
            assert "rank 1" in failed.error and "out of memory" in failed.error
            assert not prefetch.ready(first.hash)  # no step ever loads it
            prefetch.drop(first.hash, "r1")
            assert _idle(prefetch, areas)  # rank 0's good copy is dropped too: nothing kept under the hash
            assert all(area.take(failed.offset, first.hash) is None for area in areas)
            assert prefetch.want(fresh.hash, fresh, "r2") is not None
            assert _settled(prefetch, fresh.hash) is State.READY
            load, _ = prefetch.to_workers(fresh.hash, "r2")
            for area in areas:  # the real values, in the model's dtype, on every rank
                got = area.take(load.offset, fresh.hash)
                assert got.dtype == torch.bfloat16 and torch.equal(got, rows.to(torch.bfloat16))
                assert got is area.take(load.offset, fresh.hash)  # a step only takes it
            prefetch.copied([fresh.hash])
            assert _idle(prefetch, areas)
        finally:
            prefetch.close()
    assert wait_for(lambda: _entries(producer) == 0, 30)


def _connector(producer, address: LandingAddress) -> EricECConnector:
    """The connector's scheduler side as vLLM builds it, for a model whose rows are WIDTH wide."""
    extra = {"eric_urls": [producer.url], "backends": ["http"], "fetch_timeout_s": 0.5, "staging_bytes": 1 << 20}
    config = SimpleNamespace(
        ec_transfer_config=ECTransferConfig(
            ec_connector="EricECConnector", ec_role="ec_consumer", ec_connector_extra_config=extra
        ),
        parallel_config=SimpleNamespace(data_parallel_rank=address.dp_rank, tensor_parallel_size=2),
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


def test_connector_serves_an_image_again_after_its_landing_timed_out(producer) -> None:
    """The scheduler side of the connector: the request whose landing timed out fails; the same image then comes
    with a fresh lease, lands, and goes to the workers with the right values."""
    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    first, fresh = _entry(producer, "connector-image", seed=0, data=rows)
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
            connector.update_state_after_alloc(r2, 0)
            meta = connector.build_connector_meta(
                SimpleNamespace(  # type: ignore[arg-type]
                    scheduled_encoder_inputs={}, free_encoder_mm_hashes=[], total_num_scheduled_tokens=1
                )
            )
            (load,) = meta.loads  # type: ignore[attr-defined]
            assert load.request_id == "r2" and load.staged is not None
            for area in areas:
                assert torch.equal(area.take(load.staged.offset, fresh.hash), rows)
            connector.update_connector_output(
                ECConnectorOutput(ec_connector_worker_meta=EricWorkerMetadata(copied={fresh.hash}))
            )
            connector.request_finished(r2)
            assert not connector.take_unavailable_requests()
            assert _idle(connector.scheduler._prefetch, areas)
        finally:
            connector.shutdown()
    assert wait_for(lambda: _entries(producer) == 0, 30)


def test_connector_follows_vllms_encoder_cache_through_reset_and_eviction(producer) -> None:
    """The connector reads vLLM's own encoder cache manager (no copy of its own): an item vLLM holds is not fetched;
    one vLLM evicts in the very pass that needs it is still a load (the workers keep its rows), never a failure;
    after vLLM resets the cache the next request fetches the item again and loads its real rows."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    h1, h2, h3 = _entry(producer, "reset-image", seed=0, leases=3, data=rows)
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
            assert _idle(connector.scheduler._prefetch, areas)
        finally:
            connector.shutdown()
    assert wait_for(lambda: _entries(producer) == 0, 30)


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def test_consumer_unmaps_the_pool_of_a_restarted_eric() -> None:
    """Eric restarts (gracefully, then killed: its segment then stays on /dev/shm): each time the consumer's next
    read maps the new pool and drops the old one."""
    fetcher = EmbeddingFetcher(("shm",))
    leaked = []
    try:
        with PoolServer(backends="shm", pool_bytes=1 << 20) as eric:
            names = []
            for restart in ("graceful", "killed", None):
                h = _entry(eric, f"before-{restart}", seed=3, leases=1)[0]
                assert np.array_equal(fetcher.fetch(h).numpy(), seeded_bytes(ITEM, 3))
                names.append(h.shm.name)  # type: ignore[union-attr]
                assert f"/dev/shm/{names[-1]}" in _maps()
                assert [n for n in names[:-1] if f"/dev/shm/{n}" in _maps()] == []  # every former pool unmapped
                if restart == "graceful":
                    eric.stop()
                elif restart == "killed":
                    os.killpg(eric.proc.pid, signal.SIGKILL)
                    eric.proc.wait()
                    eric.proc = None
                    leaked.append(names[-1])
                    assert os.path.exists(f"/dev/shm/{names[-1]}")
                if restart is not None:
                    eric.start()
            assert len(set(names)) == 3 and fetcher._backend("shm").mapped() == [names[-1]]  # type: ignore[attr-defined]
    finally:
        fetcher.close()
        for name in leaked:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_handles_no_item_takes_go_back_at_once_and_a_refused_set_returns_its_valid_ones(producer) -> None:
    """A handle none of the request's items names (an item vLLM renamed, or a stray) goes back as soon as the
    connector reads the request, not at its lease's TTL; a request whose handles are refused as a whole (one names
    a producer not configured) fails, and its valid handles go back too (the stranger is never contacted)."""
    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    (used,) = _entry(producer, "offer-used", seed=1, leases=1, data=rows)
    (stray,) = _entry(producer, "offer-stray", seed=2, leases=1, data=rows)
    address = LandingAddress(f"offer{uuid.uuid4().hex[:8]}")
    connector = _connector(producer, address)
    try:
        r1 = _request("r1", used)
        r1.sampling_params.extra_args = handles_xargs([used, stray])
        assert set(connector.scheduler._offers_of(r1) or {}) == {used.hash}
        assert wait_for(lambda: _entries(producer) == 1, 30)  # the stray's lease acked, the used one still held
        connector.request_finished(r1)
        assert wait_for(lambda: _entries(producer) == 0, 30)

        (valid,) = _entry(producer, "offer-valid", seed=3, leases=1, data=rows)
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
        assert wait_for(lambda: _entries(producer) == 0, 30)  # the valid handle's lease came back at once
        connector.request_finished(r2)
    finally:
        connector.shutdown()
