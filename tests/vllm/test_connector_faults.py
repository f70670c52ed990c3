"""Faults in the vLLM connector's landing leave nothing broken (real producer process, real ZMQ sockets, two ranks):
a landing that times out on a stalled Eric is fetched again by the next request with a fresh lease, its range, the
ranks' copies and the lease come back once every rank has answered, a request that finds no room waits only so long,
a rank whose copy fails fails the item and keeps nothing, and a consumer unmaps the pool of an Eric that restarted.
The connector's scheduler side under such faults: test_connector_scheduler_faults.py."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import torch

from eric_epd.plugins.vllm.landing import LandingAddress, LandingArea, LandingChannel
from eric_epd.plugins.vllm.staging import Prefetcher, State
from eric_epd.testing.pool_server import seeded_bytes
from eric_epd.testing.server import PoolServer
from eric_epd.testing.stack import wait_for
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.wire.handles import LEASE_HEADER
from tests.support import helpers_landing
from tests.support.helpers_landing import ITEM, WIDTH, landing_idle, pool_entries, pool_entry, ranks, stalled

producer = helpers_landing.producer  # the module's producer process (a module-scoped fixture)


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


def _settled(prefetch: Prefetcher, key: str) -> State:
    assert wait_for(lambda: prefetch.get(key).state is not State.PENDING, 60, 0.05)  # type: ignore[union-attr]
    return prefetch.get(key).state  # type: ignore[union-attr]


def test_timed_out_landing_is_fetched_again_with_a_fresh_lease(producer) -> None:
    with landing(1 << 20) as (prefetch, areas):
        first, fresh = pool_entry(producer, "stalled-item", seed=11)
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
        assert landing_idle(prefetch, areas)
        assert wait_for(lambda: pool_entries(producer) == 0, 30)  # r2 acknowledged; r1's lease given back
        assert failed.late == 0 and not failed.unacked


def test_repeated_timeouts_give_staging_space_back_and_room_waits_end(producer) -> None:
    keys = [f"repeat{i}" for i in range(3)]
    handles = {key: pool_entry(producer, key, seed=20 + i) for i, key in enumerate(keys)}
    extra = pool_entry(producer, "no-room", seed=29, leases=1)[0]
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
        assert landing_idle(prefetch, areas)  # back to its starting free amount
        for i, key in enumerate(keys):
            assert prefetch.want(key, handles[key][1], f"again-{key}") is not None
            assert _settled(prefetch, key) is State.READY
            load, _ = prefetch.to_workers(key, f"again-{key}")
            for area in areas:
                assert np.array_equal(area.take(load.offset, key).numpy(), seeded_bytes(ITEM, 20 + i))
            prefetch.copied([key])
        assert landing_idle(prefetch, areas)
    httpx.post(
        f"{producer.url}/v1/embeddings/{extra.hash}/ack",
        headers={LEASE_HEADER: extra.lease},
        json={"instance_id": extra.instance_id},
        timeout=30,
    )
    assert wait_for(lambda: pool_entries(producer) == 0, 30)


def test_a_rank_whose_copy_fails_fails_the_item_and_keeps_nothing(producer) -> None:
    rows = torch.randn(ITEM // 4 // WIDTH, WIDTH)
    first, fresh = pool_entry(producer, "copy-fails", seed=0, data=rows)
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
            assert landing_idle(prefetch, areas)  # rank 0's good copy is dropped too: nothing kept under the hash
            assert all(area.take(failed.offset, first.hash) is None for area in areas)
            assert prefetch.want(fresh.hash, fresh, "r2") is not None
            assert _settled(prefetch, fresh.hash) is State.READY
            load, _ = prefetch.to_workers(fresh.hash, "r2")
            for area in areas:  # the real values, in the model's dtype, on every rank
                got = area.take(load.offset, fresh.hash)
                assert got.dtype == torch.bfloat16 and torch.equal(got, rows.to(torch.bfloat16))
                assert got is area.take(load.offset, fresh.hash)  # a step only takes it
            prefetch.copied([fresh.hash])
            assert landing_idle(prefetch, areas)
        finally:
            prefetch.close()
    assert wait_for(lambda: pool_entries(producer) == 0, 30)


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
                h = pool_entry(eric, f"before-{restart}", seed=3, leases=1)[0]
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
