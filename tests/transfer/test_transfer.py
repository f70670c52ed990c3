"""Transfer layer: the same-host shm backend across processes, and every backend through a live Eric (the pool's
bookkeeping is in test_pool.py)."""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from eric_epd.stack.process import new_key
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.backends.shm import ShmConsumer, ShmProducer
from eric_epd.transfer.client import EmbeddingFetcher, as_handle
from eric_epd.transfer.free_list import ALIGN
from eric_epd.transfer.pool import MAX_CHILD_LEASES, EmbeddingPool, new_token
from eric_epd.wire.handles import LEASE_HEADER, EmbeddingHandle

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _data(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


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
            resp = httpx.post(
                producer.url + "/v1/testing/entries",
                json={"hash": f"e{i}", "nbytes": size, "seed": i, "leases": 100},
                timeout=60,
            )
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


def _encode(eric: EricServer, urls: list[str]) -> list[dict]:
    resp = httpx.post(
        eric.url + "/v1/encode",
        json={"items": [{"modality": "image", "url": u} for u in urls]},
        headers=eric.headers,
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["items"]


def _transfer_stats(eric: EricServer) -> dict:
    resp = httpx.get(eric.url + "/v1/transfer", headers=eric.headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _leased(eric: EricServer, token: str | None) -> dict[str, str]:
    """Eric's key plus, when given, a lease token."""
    return eric.headers | ({LEASE_HEADER: token} if token is not None else {})


IMAGES = [image_data_url(64 + 16 * i, 80, seed=500 + i) for i in range(4)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_through_backend_equals_http(eric: EricServer, backend: str) -> None:
    items = _encode(eric, IMAGES)
    fetcher = EmbeddingFetcher([backend], api_key=eric.api_key)
    http = EmbeddingFetcher(["http"], api_key=eric.api_key)
    try:
        for item in items:
            h = as_handle(item["handle"])
            assert getattr(h, backend) is not None and h.lease
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
    fetcher = EmbeddingFetcher(api_key=eric.api_key)
    items = _encode(eric, IMAGES) + _encode(eric, IMAGES[:2])  # the repeat leases the same entries
    assert len({i["hash"] for i in items}) == 4
    assert len({i["handle"]["lease"] for i in items}) == len(items)  # every item its own lease
    stats = _transfer_stats(eric)
    assert stats["entries"] == 4 and stats["used_bytes"] > 0
    with ThreadPoolExecutor(6) as pool:
        tensors = list(pool.map(lambda item: fetcher.fetch(item["handle"]), items))
    assert all(torch.isfinite(t).all() for t in tensors)
    assert torch.equal(tensors[0], tensors[4])
    stats = _transfer_stats(eric)
    assert stats["entries"] == 0 and stats["used_bytes"] == 0
    fetcher.close()


def _assert_401(resp: httpx.Response, what: str) -> None:
    assert resp.status_code == 401, (what, resp.status_code, resp.text)
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"], what
    assert isinstance(error["type"], str) and error["type"], what
    assert error["code"] == 401, what


def test_api_key_and_lease_tokens_guard_every_route(eric: EricServer) -> None:
    """Without Eric's key every data route is a 401 (even with a valid lease token); /health and /metrics stay
    open. With the key, a missing, made-up or other entry's lease token gets a 404 on the per-embedding routes and
    changes nothing: the owner's single ack still frees the entry, so no lease was added or taken."""
    base = _transfer_stats(eric)
    items = _encode(eric, [image_data_url(72, 56, seed=4242), image_data_url(56, 72, seed=4243)])
    item, other = items
    h, token = item["hash"], item["handle"]["lease"]
    emb = f"{eric.url}/v1/embeddings/{h}"
    held = _transfer_stats(eric)
    assert held["entries"] == base["entries"] + 2 and held["used_bytes"] > base["used_bytes"]
    owner_bytes = httpx.get(emb, headers=_leased(eric, token))
    assert owner_bytes.status_code == 200

    routes = [
        ("POST", eric.url + "/v1/encode", {"items": [{"modality": "image", "url": IMAGES[0]}]}),
        ("GET", emb, None),
        ("GET", emb + "/handle", None),
        ("POST", emb + "/lease", {"count": 1}),
        ("POST", emb + "/ack", {}),
        ("GET", eric.url + "/v1/transfer", None),
        ("GET", eric.url + "/v1/models", None),
        ("GET", eric.url + "/v1/transfer/nixl/metadata", None),
    ]
    for keys in ({}, {"Authorization": "Bearer wrong-" + eric.api_key}, {"Authorization": eric.api_key}):
        for method, url, body in routes:
            resp = httpx.request(method, url, json=body, headers=keys | {LEASE_HEADER: token}, timeout=30)
            _assert_401(resp, (method, url, keys))
        for open_path in ("/health", "/metrics"):
            assert httpx.get(eric.url + open_path, headers=keys).status_code == 200, open_path

    strangers = {"no token": None, "made up": new_token(), "empty": "", "another entry's": other["handle"]["lease"]}
    for name, bad in strangers.items():
        headers = _leased(eric, bad)
        for method, url, body in [
            ("GET", emb, None),
            ("GET", emb + "/handle", None),
            ("POST", emb + "/lease", {"count": 1024}),
            ("POST", emb + "/lease", {"count": 1}),
            ("POST", emb + "/ack", {}),
            ("POST", emb + "/ack", None),
        ]:
            resp = httpx.request(method, url, json=body, headers=headers, timeout=30)
            assert resp.status_code == 404, (name, method, url, resp.status_code, resp.text)
            assert resp.json()["error"]["code"] == 404, (name, url)
        stats = _transfer_stats(eric)
        assert (stats["entries"], stats["used_bytes"]) == (held["entries"], held["used_bytes"]), name

    # beyond the child-lease bound: a 400 that adds nothing, with the owner's own token
    for count in (MAX_CHILD_LEASES + 1, 1024):
        resp = httpx.post(emb + "/lease", json={"count": count}, headers=_leased(eric, token), timeout=30)
        assert resp.status_code == 400, (count, resp.text)
        assert resp.json()["error"]["code"] == 400

    # the owner still reads (the same bytes) and sees its handle; then its one ack frees the entry
    again = httpx.get(emb, headers=_leased(eric, token))
    assert again.status_code == 200 and again.content == owner_bytes.content
    handle = httpx.get(emb + "/handle", headers=_leased(eric, token))
    assert handle.status_code == 200 and handle.json()["lease"] == token and handle.json()["hash"] == h
    assert httpx.post(emb + "/ack", headers=_leased(eric, token)).status_code == 200
    stats = _transfer_stats(eric)
    assert stats["entries"] == held["entries"] - 1 and stats["used_bytes"] < held["used_bytes"]
    assert httpx.post(emb + "/ack", headers=_leased(eric, token)).status_code == 404  # exactly once
    assert httpx.get(emb, headers=_leased(eric, token)).status_code == 404
    ack_other = httpx.post(
        f"{eric.url}/v1/embeddings/{other['hash']}/ack", headers=_leased(eric, other["handle"]["lease"])
    )
    assert ack_other.status_code == 200, ack_other.text
    stats = _transfer_stats(eric)
    assert (stats["entries"], stats["used_bytes"]) == (base["entries"], base["used_bytes"])


def test_ack_from_another_instance_is_409(eric: EricServer) -> None:
    """The ack body's instance_id names the Eric the handle came from: one from a restarted Eric is a 409 that
    keeps the lease; the right one (or none) ends it."""
    item = _encode(eric, [image_data_url(48, 48, seed=4300)])[0]
    url = f"{eric.url}/v1/embeddings/{item['hash']}/ack"
    headers = _leased(eric, item["handle"]["lease"])
    gone = httpx.post(url, json={"instance_id": "not-" + item["handle"]["instance_id"]}, headers=headers)
    assert gone.status_code == 409 and "restarted" in gone.json()["error"]["message"]
    assert httpx.post(url, json={"instance_id": item["handle"]["instance_id"]}, headers=headers).status_code == 200
    assert httpx.post(url, json={"instance_id": item["handle"]["instance_id"]}, headers=headers).status_code == 404
    assert _transfer_stats(eric)["entries"] == 0


def test_an_ack_with_keep_answers_a_child_lease_in_its_place(eric: EricServer) -> None:
    """`"keep": true` ends the lease as an ack does and answers a child lease that reads the same bytes and holds the
    entry until its own ack; a retry of it gets the same child; an ended lease, or one with no child budget left, gets
    none; a keep that is not a boolean is a 400 that changes nothing."""
    base = _transfer_stats(eric)["entries"]
    item = _encode(eric, [image_data_url(64, 48, seed=4400)])[0]
    emb, token = f"{eric.url}/v1/embeddings/{item['hash']}", item["handle"]["lease"]
    read = httpx.get(emb, headers=_leased(eric, token))
    assert read.status_code == 200
    bad = httpx.post(emb + "/ack", json={"keep": "yes"}, headers=_leased(eric, token))
    assert bad.status_code == 400 and '"keep"' in bad.json()["error"]["message"]

    answer = httpx.post(emb + "/ack", json={"keep": True}, headers=_leased(eric, token))
    assert answer.status_code == 200, answer.text
    child = answer.json()["lease"]
    assert answer.json()["status"] == "ok" and child not in ("", token)
    assert httpx.get(emb, headers=_leased(eric, token)).status_code == 404  # the acknowledged lease ended
    assert httpx.get(emb, headers=_leased(eric, child)).content == read.content  # the child reads the same bytes
    assert _transfer_stats(eric)["entries"] == base + 1
    # a retry (its first attempt's answer lost) is answered that attempt's child again, not a second one
    retried = httpx.post(emb + "/ack", json={"keep": True, "retry": True}, headers=_leased(eric, token))
    assert retried.status_code == 200 and retried.json() == {"status": "already acknowledged", "lease": child}
    assert httpx.post(emb + "/ack", json={"keep": True}, headers=_leased(eric, token)).status_code == 404

    # the child's own children exhaust the root's budget: its ack with keep still ends it, with no child
    grand = httpx.post(emb + "/lease", json={"count": MAX_CHILD_LEASES - 1}, headers=_leased(eric, child))
    assert grand.status_code == 200, grand.text
    last = httpx.post(emb + "/ack", json={"keep": True}, headers=_leased(eric, child))
    assert last.status_code == 200 and last.json() == {"status": "ok"}
    for lease in grand.json()["leases"]:
        assert httpx.post(emb + "/ack", headers=_leased(eric, lease)).status_code == 200
    assert _transfer_stats(eric)["entries"] == base


def test_ttl_expiry_gives_clear_error(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    with EricServer(qwen2_vl_tiny, extra_args=("--embedding-ttl", "1"), log_path=tmp_path / "e.log") as eric:
        item = _encode(eric, IMAGES[:1])[0]
        deadline = time.monotonic() + 10
        while _transfer_stats(eric)["entries"]:
            assert time.monotonic() < deadline, "entry never expired"
            time.sleep(0.2)
        with pytest.raises(TransferError, match=r"no longer valid|expired"):
            EmbeddingFetcher(["shm", "http"], api_key=eric.api_key).fetch(item["handle"])


def test_fetch_after_producer_restart_fails_clearly(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    from eric_epd.stack.process import free_port

    port, key = free_port(), new_key()  # the same key: the old handle fails on its lease, not on the key
    args = ("--transfer-backends", "shm,mooncake,nixl")
    with EricServer(qwen2_vl_tiny, port=port, extra_args=args, log_path=tmp_path / "a.log", api_key=key) as eric:
        item = _encode(eric, IMAGES[:1])[0]
    with EricServer(qwen2_vl_tiny, port=port, extra_args=args, log_path=tmp_path / "b.log", api_key=key) as eric:
        for backends in (["shm"], ["mooncake"], ["nixl"], ["http"]):
            start = time.monotonic()
            with pytest.raises(TransferError):
                EmbeddingFetcher(backends, api_key=key).fetch(item["handle"])
            assert time.monotonic() - start < 15
        fresh = _encode(eric, IMAGES[:1])[0]  # same content, new instance: a new, valid handle
        assert fresh["hash"] == item["hash"] and fresh["handle"]["instance_id"] != item["handle"]["instance_id"]
        assert fresh["handle"]["lease"] != item["handle"]["lease"]
        assert torch.isfinite(EmbeddingFetcher(["shm"], api_key=key).fetch(fresh["handle"])).all()


def test_full_pool_back_pressure(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Each 224x224 image is 64 tokens x 128 x 4 B = 32 KiB; a 72 KiB pool holds two."""
    args = ("--pool-bytes", str(72 << 10), "--pool-wait", "0.5")
    with EricServer(qwen2_vl_tiny, extra_args=args, log_path=tmp_path / "e.log") as eric:
        big = [image_data_url(224, 224, seed=900 + i) for i in range(3)]
        first = _encode(eric, big[:2])
        resp = httpx.post(
            eric.url + "/v1/encode",
            json={"items": [{"modality": "image", "url": big[2]}]},
            headers=eric.headers,
            timeout=30,
        )
        assert resp.status_code == 503 and "pool full" in resp.json()["error"]["message"]
        assert "retry-after" in resp.headers
        EmbeddingFetcher(["shm"], api_key=eric.api_key).fetch(first[0]["handle"])  # ack frees one slot
        assert len(_encode(eric, big[2:])) == 1
        assert httpx.get(eric.url + "/health").status_code == 200
