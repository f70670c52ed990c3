"""Two Erics sharing finished embeddings through Mooncake Store (its master started by the project's launcher): an
image Eric A encoded serves Eric B without a second encode (B's counters prove it, and the bytes are A's); with the
store down each Eric serves from its own pool, logged, and no request fails."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from eric_epd.stack.process import new_key, running, start_all, stop_all
from eric_epd.stack.servers import EricServer, StoreMaster
from eric_epd.testing.media import image_data_url
from eric_epd.testing.pools import wait_pool_drained
from eric_epd.testing.stack import metric, wait_for
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher, MooncakeOptions
from eric_epd.transfer.safetensors_io import safetensors_payload
from eric_epd.wire.handles import LEASE_HEADER


def _encode(eric: EricServer, url: str) -> dict:
    r = httpx.post(
        eric.url + "/v1/encode", json={"items": [{"modality": "image", "url": url}]}, headers=eric.headers, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["items"][0]


def _bytes(eric: EricServer, item: dict) -> bytes:
    handle = item["handle"]
    r = httpx.get(handle["http"], headers=eric.headers | {LEASE_HEADER: handle["lease"]}, timeout=30)
    assert r.status_code == 200, r.text
    httpx.post(
        f"{handle['producer']}/v1/embeddings/{handle['hash']}/ack",
        headers=eric.headers | {LEASE_HEADER: handle["lease"]},
        json={"instance_id": handle["instance_id"]},
        timeout=30,
    )
    return r.content


def test_an_image_encoded_by_one_eric_serves_another_without_a_second_encode(
    qwen2_vl_tiny: Path, tmp_path: Path
) -> None:
    key = new_key()
    with StoreMaster(tmp_path / "master.log") as master:
        cache = ("--global-cache", master.address, "--global-cache-bytes", str(64 << 20))
        with running(
            EricServer(qwen2_vl_tiny, api_key=key, extra_args=cache, log_path=tmp_path / "a.log"),
            EricServer(qwen2_vl_tiny, api_key=key, extra_args=cache, log_path=tmp_path / "b.log"),
        ) as (a, b):
            image = image_data_url(96, 80, seed=4242)
            first = _encode(a, image)
            assert wait_for(lambda: metric(a.url, 'eric_global_cache{event="puts"}') >= 1), "A never shared it"
            batches = metric(b.url, "eric_batches_total")
            second = _encode(b, image)
            assert second["hash"] == first["hash"] and second["shape"] == first["shape"]
            assert metric(b.url, 'eric_items_total{modality="image",source="global"}') == 1
            assert metric(b.url, "eric_batches_total") == batches  # B ran no batch for it
            assert _bytes(b, second) == _bytes(a, first)  # the very bytes A's encoder produced

            master.stop()  # the store goes down: each Eric serves from its own pool, no request fails
            for i, eric in enumerate((a, b)):
                fresh = _encode(eric, image_data_url(64, 64, seed=5000 + i))
                assert fresh["shape"][0] > 0 and _bytes(eric, fresh)
            again = _encode(b, image)  # still in B's own pool (or encoded again): answered either way
            assert again["hash"] == first["hash"]
            assert metric(b.url, 'eric_items_total{modality="image",source="encoded"}') >= 1
            assert _bytes(b, again)
            for eric in (a, b):  # every lease given back: exactly 0 bytes held
                wait_pool_drained(eric.url, eric.headers)
    assert "global cache" in (tmp_path / "b.log").read_text()  # the outage was logged


def test_a_consumer_reads_from_the_store_what_its_producer_let_go(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Eric A's lease on an item was acknowledged (A freed it): a consumer that knows the store still gets A's very
    bytes, by content hash, whether its first read failed (HTTP: gone) or only its ack did (shared memory); one
    that does not know the store fails cleanly."""
    key = new_key()
    with (
        StoreMaster(tmp_path / "master.log") as master,
        EricServer(qwen2_vl_tiny, api_key=key, extra_args=("--global-cache", master.address)) as a,
    ):
        item = _encode(a, image_data_url(88, 72, seed=4343))
        assert wait_for(lambda: metric(a.url, 'eric_global_cache{event="puts"}') >= 1)
        original = bytes(safetensors_payload(_bytes(a, item)))  # read, then acknowledged: A lets it go
        store = MooncakeOptions(global_cache=master.address)
        for backends in (("http",), ("shm", "http")):
            with pytest.raises(TransferError):
                EmbeddingFetcher(backends, api_key=key).fetch(item["handle"])
            fetcher = EmbeddingFetcher(backends, api_key=key, mooncake=store)
            try:
                got = fetcher.fetch(item["handle"])
                assert fetcher.last_backend == "store", backends
            finally:
                fetcher.close()
            assert got.view(torch.uint8).numpy().tobytes() == original, backends
        missing = dict(item["handle"], hash="0" * 64)  # nobody ever stored it: a clean error, no bytes
        fetcher = EmbeddingFetcher(("http",), api_key=key, mooncake=store)
        with pytest.raises(TransferError, match="not in the global cache"):
            fetcher.fetch(missing)
        with pytest.raises(TransferError, match="names no embedding"):  # not a content hash: never a store key
            fetcher.fetch(dict(item["handle"], hash="../" + item["hash"][3:]))
        fetcher.close()
        wait_pool_drained(a.url, a.headers)


def test_both_cache_tiers_stay_within_their_capacity_and_count_evictions(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """More distinct embeddings than either tier holds: this Eric's content cache (--keep-acked-bytes) evicts its
    oldest entries, and the store (the Eric's --global-cache-bytes, filled further by another client) evicts at
    its master's high watermark; both stay within capacity, their metrics show it, and the Eric still answers an
    item both tiers dropped."""
    from mooncake.store import MooncakeDistributedStore

    key, keep, segment = new_key(), 256 << 10, 16 << 20  # Mooncake's smallest segment is 16 MiB
    with StoreMaster(tmp_path / "master.log") as master:
        args = ("--global-cache", master.address, "--global-cache-bytes", str(segment), "--keep-acked-bytes", str(keep))
        with EricServer(qwen2_vl_tiny, api_key=key, extra_args=args) as a:
            images = [image_data_url(448, 448, seed=7000 + i) for i in range(24)]
            items = []
            for image in images:
                items.append(_encode(a, image))
                _bytes(a, items[-1])  # read and acknowledged: kept as cache, within the budget
            assert wait_for(lambda: metric(a.url, 'eric_global_cache{event="puts"}') >= len(items))
            size = items[0]["handle"]["nbytes"]
            assert 0 < metric(a.url, 'eric_local_cache{event="bytes"}') <= keep
            assert metric(a.url, 'eric_local_cache{event="capacity"}') == keep
            assert metric(a.url, 'eric_local_cache{event="evictions"}') >= len(items) - keep // size
            assert metric(a.url, 'eric_global_cache{event="capacity"}') == segment
            assert metric(master.url, "master_total_capacity_bytes") == segment
            assert metric(master.url, "master_allocated_bytes") >= len(items) * size

            other = MooncakeDistributedStore()  # a client lending no memory: its objects land in the Eric's share
            assert other.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
            try:
                blob = bytes(1 << 20)
                for i in range(24):
                    other.put(f"filler/{i}", blob)  # a put that finds the store full fails; eviction follows
                    time.sleep(0.05)
            finally:
                other.close()
            assert wait_for(lambda: metric(master.url, "master_evicted_key_count") > 0)
            assert metric(master.url, "master_allocated_bytes") <= segment
            again = _encode(a, images[0])  # gone from the pool, maybe from the store: answered either way
            assert again["hash"] == items[0]["hash"] and _bytes(a, again)
            stats = wait_pool_drained(a.url, a.headers)  # exactly 0 held beside the content cache
            assert 0 < stats["cached_bytes"] <= keep


def test_through_the_gateway_to_vllm_a_stored_image_is_not_encoded_again(
    vllm_behind_erics, qwen2_vl_tiny: Path, tmp_path: Path
) -> None:
    """The session's two Erics come back sharing a store; a chat through a gateway in front of Eric A, then the same
    images through one in front of Eric B: B encodes none of them, and both answers equal vLLM's own."""
    from eric_epd.stack.servers import GatewayServer
    from eric_epd.testing.stack import ask, image_messages

    erics, vllm, key = vllm_behind_erics["erics"], vllm_behind_erics["vllm"], vllm_behind_erics["eric_key"]
    images = [image_data_url(72 + 8 * k, 64, seed=6100 + k) for k in range(3)]
    expected = ask(vllm.url, image_messages(images), key=vllm.api_key).choices[0].message.content
    stop_all(*erics)
    try:
        with StoreMaster(tmp_path / "master.log") as master:
            cache = ("--global-cache", master.address, "--global-cache-bytes", str(64 << 20))
            with running(
                EricServer(qwen2_vl_tiny, port=erics[0].port, api_key=key, extra_args=cache),
                EricServer(qwen2_vl_tiny, port=erics[1].port, api_key=key, extra_args=cache),
            ) as (a, b):
                answers = []
                for eric in (a, b):
                    with GatewayServer(
                        tmp_path / f"gw-{eric.port}.log",
                        "--encoder-urls",
                        eric.url,
                        "--colocated-urls",
                        vllm.url,
                        "--api-key",
                        "sk-global",
                        eric_api_key=key,
                        upstream_api_key=vllm.api_key,
                    ) as gw:
                        answers.append(ask(gw.url, image_messages(images), key="sk-global").choices[0].message.content)
                    if eric is a:
                        assert wait_for(lambda: metric(a.url, 'eric_global_cache{event="puts"}') >= 3)
                assert answers == [expected, expected]
                assert metric(b.url, 'eric_items_total{modality="image",source="global"}') == 3
                assert metric(b.url, 'eric_items_total{modality="image",source="encoded"}') == 0
                assert metric(b.url, "eric_batches_total") == 0
                for eric in (a, b):  # vLLM acknowledged every lease
                    wait_pool_drained(eric.url, eric.headers)
    finally:
        start_all(*erics)  # the Erics are shared by the session's gateway tests


def test_a_hung_store_master_starves_no_encode_and_holds_nothing_after(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """The store's master stopped (SIGSTOP: every store call hangs until Mooncake's RPC timeout) under a real Eric
    with a 64 KiB pool: 48 new 64x64 images (2 KiB of rows each), four at a time, each batch acknowledged, are all
    answered, as the store calls run on the cache's own threads, a timed-out call pauses the store and the puts in
    flight are capped (with neither pause nor cap, each hung put held its entry: the pool filled and the fifth batch
    was a 503); once the master runs again nothing is held and the same images are answered again."""
    import os
    import signal

    key = new_key()
    with StoreMaster(tmp_path / "master.log") as master:
        args = ("--global-cache", master.address, "--global-cache-bytes", str(64 << 20), "--pool-bytes", str(64 << 10))
        with EricServer(qwen2_vl_tiny, api_key=key, extra_args=args, log_path=tmp_path / "eric.log") as eric:
            assert _bytes(eric, _encode(eric, image_data_url(64, 64, seed=6000)))  # the store works
            assert wait_for(lambda: metric(eric.url, 'eric_global_cache{event="puts"}') >= 1)
            images = [image_data_url(64, 64, seed=6001 + i) for i in range(48)]
            assert master.proc is not None
            os.kill(master.proc.pid, signal.SIGSTOP)
            try:
                for start in range(0, len(images), 4):
                    body = {"items": [{"modality": "image", "url": u} for u in images[start : start + 4]]}
                    r = httpx.post(eric.url + "/v1/encode", json=body, headers=eric.headers, timeout=120)
                    assert r.status_code == 200, (start, r.text)
                    for item in r.json()["items"]:
                        assert _bytes(eric, item)
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            wait_pool_drained(eric.url, eric.headers, timeout_s=90)  # the hung puts' holds ended with them
            again = httpx.post(
                eric.url + "/v1/encode",
                headers=eric.headers,
                timeout=120,
                json={"items": [{"modality": "image", "url": u} for u in images[:4]]},
            )
            assert again.status_code == 200, again.text
            for item in again.json()["items"]:
                assert _bytes(eric, item)
            wait_pool_drained(eric.url, eric.headers)
