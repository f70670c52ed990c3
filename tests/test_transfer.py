"""Transfer layer: the pool, the same-host shm backend across processes, and every backend through a live Eric."""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from eric_epd.testing.media import image_data_url
from eric_epd.testing.server import EricServer
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.backends.shm import ShmConsumer, ShmProducer
from eric_epd.transfer.client import EmbeddingFetcher, as_handle
from eric_epd.transfer.handles import EmbeddingHandle
from eric_epd.transfer.pool import ALIGN, EmbeddingPool, FreeList

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _data(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def test_free_list_coalesces() -> None:
    fl = FreeList(10 * ALIGN)
    a, b, c = fl.allocate(ALIGN), fl.allocate(3 * ALIGN - 5), fl.allocate(ALIGN)
    assert (a, b, c) == (0, ALIGN, 4 * ALIGN)
    assert fl.allocate(6 * ALIGN) is None
    fl.free(b, 3 * ALIGN - 5)
    fl.free(a, ALIGN)
    fl.free(c, ALIGN)
    assert fl.free_bytes == 10 * ALIGN and fl.allocate(10 * ALIGN) == 0


def test_pool_lease_ack_expire() -> None:
    pool = EmbeddingPool(f"eric-test-{time.monotonic_ns()}", 1 << 20, ttl_s=0.2)
    try:
        e = pool.reserve("h", 1000, (10, 25), "float32")
        assert e is not None and pool.used_bytes >= 1000
        assert pool.reserve("big", 2 << 20, (1,), "float32") is None
        pool.commit("h")
        pool.lease("h")
        pool.lease("h")
        assert pool.ack("h") and pool.get("h") is not None  # one lease left
        assert pool.ack("h") and pool.get("h") is None and pool.used_bytes == 0
        assert not pool.ack("h")
        pool.reserve("t", 10, (10,), "float32")
        pool.commit("t")
        pool.lease("t")
        assert pool.expire(time.monotonic() + 1) == ["t"] and pool.used_bytes == 0
    finally:
        pool.close()


def test_pool_keeps_acked_entries_as_cache() -> None:
    pool = EmbeddingPool(f"eric-test-{time.monotonic_ns()}", 4 * ALIGN, ttl_s=60, keep_acked_bytes=2 * ALIGN)
    try:
        for key in ("a", "b"):
            pool.reserve(key, ALIGN, (ALIGN,), "uint8")
            pool.commit(key)
            pool.lease(key)
            assert pool.ack(key)
        assert len(pool) == 0 and pool.used_bytes == 0 and pool.cached_bytes == 2 * ALIGN
        assert pool.get("a") is not None and not pool.ack("a")  # cached, not leased
        pool.lease("a")  # a repeat: served from the cache, no encode
        assert len(pool) == 1 and pool.cached_bytes == ALIGN
        assert pool.reserve("big", 3 * ALIGN, (1,), "uint8") is not None  # evicts "b" to make room
        assert pool.get("b") is None and pool.get("a") is not None
    finally:
        pool.close()


def _shm_producer(name: str, sizes: list[int], out: mp.Queue, done: mp.Event) -> None:
    pool = EmbeddingPool(name, sum(s + ALIGN for s in sizes), ttl_s=60)
    backend = ShmProducer(name)
    handles = []
    for i, size in enumerate(sizes):
        entry = pool.reserve(f"k{i}", size, (size,), "uint8")
        pool.view(entry)[:] = _data(size, i)
        loc = backend.location(entry.offset)
        handles.append(EmbeddingHandle(f"k{i}", (size,), "uint8", size, "http://unused", "x", "", shm=loc))
    import msgspec

    out.put([msgspec.msgpack.encode(h) for h in handles])
    done.wait(120)
    pool.close()


def test_shm_two_process_byte_exact_and_concurrent() -> None:
    import msgspec

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    name = f"eric-test-shm-{time.monotonic_ns()}"
    proc = ctx.Process(target=_shm_producer, args=(name, SIZES, q, done))
    proc.start()
    try:
        handles = [msgspec.msgpack.decode(b, type=EmbeddingHandle) for b in q.get(timeout=60)]
        consumer = ShmConsumer()
        for i, h in enumerate(handles):
            dst = np.empty(h.nbytes, np.uint8)
            consumer.read(h, dst)
            assert np.array_equal(dst, _data(h.nbytes, i))

        def one(i: int) -> bool:
            h = handles[i % len(handles)]
            dst = np.empty(h.nbytes, np.uint8)
            consumer.read(h, dst)
            return bool(np.array_equal(dst, _data(h.nbytes, i % len(handles))))

        with ThreadPoolExecutor(16) as pool:
            assert all(pool.map(one, range(16)))
        consumer.close()
    finally:
        done.set()
        proc.join(30)
    # the producer is gone: its segment too
    with pytest.raises(TransferError, match="gone"):
        ShmConsumer().read(handles[0], np.empty(handles[0].nbytes, np.uint8))


def test_every_backend_byte_exact_from_a_producer_process() -> None:
    """A model-free producer process (Eric's pool, backends and control API) serves 4 KiB..64 MiB entries; each
    backend delivers them byte-exact, also 16 at a time."""
    from eric_epd.testing.pool_server import seeded_bytes
    from eric_epd.testing.server import PoolServer

    with PoolServer(pool_bytes=200 << 20) as producer:
        handles = []
        for i, size in enumerate(SIZES):
            resp = httpx.post(producer.url + "/v1/testing/entries",
                              json={"hash": f"e{i}", "nbytes": size, "seed": i, "leases": 100}, timeout=60)
            assert resp.status_code == 200, resp.text
            handles.append(as_handle(resp.json()))
        for backend in ("shm", "nixl", "mooncake", "http"):
            fetcher = EmbeddingFetcher([backend], http_timeout_s=60)
            for i, h in enumerate(handles):
                dst = np.empty(h.nbytes, np.uint8)
                fetcher.read_into(h, dst)
                assert fetcher.last_backend == backend
                assert np.array_equal(dst, seeded_bytes(h.nbytes, i)), (backend, h.nbytes)

            def one(i: int, f: EmbeddingFetcher = fetcher) -> bool:
                h = handles[i % 3]  # the three smaller sizes, 16 concurrent reads
                dst = np.empty(h.nbytes, np.uint8)
                f.read_into(h, dst)
                return bool(np.array_equal(dst, seeded_bytes(h.nbytes, i % 3)))

            with ThreadPoolExecutor(16) as pool:
                assert all(pool.map(one, range(16))), backend
            fetcher.close()


# ---- through a live Eric ----------------------------------------------------------------------------------------

BACKENDS = ["shm", "mooncake", "nixl"]


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("eric") / "eric.log"
    args = ("--transfer-backends", ",".join(BACKENDS))
    with EricServer(qwen2_vl_tiny, tp=2, extra_args=args, log_path=log) as server:
        yield server


def _encode(url: str, urls: list[str]) -> list[dict]:
    resp = httpx.post(url + "/v1/encode", json={"items": [{"modality": "image", "url": u} for u in urls]},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["items"]


def _transfer_stats(url: str) -> dict:
    return httpx.get(url + "/v1/transfer").json()


IMAGES = [image_data_url(64 + 16 * i, 80, seed=500 + i) for i in range(4)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_through_backend_equals_http(eric: EricServer, backend: str) -> None:
    items = _encode(eric.url, IMAGES)
    fetcher = EmbeddingFetcher([backend])
    http = EmbeddingFetcher(["http"])
    try:
        for item in items:
            h = as_handle(item["handle"])
            assert getattr(h, backend) is not None
            ours = fetcher.fetch(h, ack=False)
            assert fetcher.last_backend == backend
            ref = http.fetch(h)  # acks the lease
            assert ours.dtype == torch.float32 and list(ours.shape) == item["shape"]
            assert torch.equal(ours, ref)
            out = torch.empty(item["shape"])
            with pytest.raises(TransferError, match="no longer valid"):  # the one lease was acknowledged
                fetcher.fetch(h, out=out)
    finally:
        fetcher.close()
        http.close()


def test_acks_return_pool_to_zero(eric: EricServer) -> None:
    fetcher = EmbeddingFetcher()
    items = _encode(eric.url, IMAGES) + _encode(eric.url, IMAGES[:2])  # the repeat leases the same entries
    assert len({i["hash"] for i in items}) == 4
    stats = _transfer_stats(eric.url)
    assert stats["entries"] == 4 and stats["used_bytes"] > 0
    with ThreadPoolExecutor(6) as pool:
        tensors = list(pool.map(lambda item: fetcher.fetch(item["handle"]), items))
    assert all(torch.isfinite(t).all() for t in tensors)
    assert torch.equal(tensors[0], tensors[4])
    stats = _transfer_stats(eric.url)
    assert stats["entries"] == 0 and stats["used_bytes"] == 0
    fetcher.close()


def test_ttl_expiry_gives_clear_error(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    with EricServer(qwen2_vl_tiny, extra_args=("--embedding-ttl", "1"), log_path=tmp_path / "e.log") as eric:
        item = _encode(eric.url, IMAGES[:1])[0]
        deadline = time.monotonic() + 10
        while _transfer_stats(eric.url)["entries"]:
            assert time.monotonic() < deadline, "entry never expired"
            time.sleep(0.2)
        with pytest.raises(TransferError, match=r"no longer valid|expired"):
            EmbeddingFetcher(["shm", "http"]).fetch(item["handle"])


def test_fetch_after_producer_restart_fails_clearly(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    from eric_epd.testing.server import free_port

    port = free_port()
    args = ("--transfer-backends", "shm,mooncake,nixl")
    with EricServer(qwen2_vl_tiny, port=port, extra_args=args, log_path=tmp_path / "a.log") as eric:
        item = _encode(eric.url, IMAGES[:1])[0]
    with EricServer(qwen2_vl_tiny, port=port, extra_args=args, log_path=tmp_path / "b.log") as eric:
        for backends in (["shm"], ["mooncake"], ["nixl"], ["http"]):
            start = time.monotonic()
            with pytest.raises(TransferError):
                EmbeddingFetcher(backends).fetch(item["handle"])
            assert time.monotonic() - start < 15
        fresh = _encode(eric.url, IMAGES[:1])[0]  # same content, new instance: a new, valid handle
        assert fresh["hash"] == item["hash"] and fresh["handle"]["instance_id"] != item["handle"]["instance_id"]
        assert torch.isfinite(EmbeddingFetcher(["shm"]).fetch(fresh["handle"])).all()


def test_full_pool_back_pressure(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Each 224x224 image is 64 tokens x 128 x 4 B = 32 KiB; a 72 KiB pool holds two."""
    args = ("--pool-bytes", str(72 << 10), "--pool-wait", "0.5")
    with EricServer(qwen2_vl_tiny, extra_args=args, log_path=tmp_path / "e.log") as eric:
        big = [image_data_url(224, 224, seed=900 + i) for i in range(3)]
        first = _encode(eric.url, big[:2])
        resp = httpx.post(eric.url + "/v1/encode", json={"items": [{"modality": "image", "url": big[2]}]}, timeout=30)
        assert resp.status_code == 503 and "pool full" in resp.json()["error"]["message"]
        assert "retry-after" in resp.headers
        EmbeddingFetcher(["shm"]).fetch(first[0]["handle"])  # ack frees one slot
        assert len(_encode(eric.url, big[2:])) == 1
        assert httpx.get(eric.url + "/health").status_code == 200
