"""A real Eric server (router, engine and worker processes): encode, fetch, batching by modality, metrics."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load as load_safetensors

from eric_epd.common.ports import free_port
from eric_epd.eric.metrics import STAGES
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_bytes, image_data_url, random_image, video_data_url
from eric_epd.wire.handles import LEASE_HEADER


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """TP 2 with two batches in flight (the CUDA default; CPU's is one): the next batch is broadcast while one runs."""
    log = tmp_path_factory.mktemp("eric") / "eric.log"
    with EricServer(
        qwen2_vl_tiny,
        tp=2,
        log_path=log,
        media_hosts=("127.0.0.1",),  # reaches a closed port
        extra_args=("--max-batch-items", "8", "--max-body-bytes", str(2**20), "--batches-in-flight", "2"),
    ) as server:
        yield server


def _encode(eric: EricServer, items: list[dict], timeout: float = 60) -> httpx.Response:
    return httpx.post(eric.url + "/v1/encode", json={"items": items}, headers=eric.headers, timeout=timeout)


def _fetch(eric: EricServer, item: dict) -> httpx.Response:
    """The item's embedding over HTTP, read with its own lease."""
    return httpx.get(item["handle"]["http"], headers=eric.headers | {LEASE_HEADER: item["handle"]["lease"]})


def _metric_samples(text: str, name: str) -> dict[str, float]:
    """label-string -> value for one metric family in Prometheus text."""
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_models_and_health(eric: EricServer) -> None:
    assert httpx.get(eric.url + "/v1/models").status_code == 401  # the key is needed, /health is open
    models = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
    assert models["tp_size"] == 2 and set(models["modalities"]) == {"image", "video"}
    assert models["placement"] == "grid"  # the engine places a Qwen item by its grid (a metadata-only part)
    assert models["takes_audio"] is False  # the gateway refuses audio for this model
    health = httpx.get(eric.url + "/health")
    assert health.status_code == 200 and len(health.json()["worker_pids"]) == 2


def test_encode_matches_transformers(eric: EricServer, qwen2_vl_tiny: Path) -> None:
    """The served embedding equals transformers' get_image_features on the same checkpoint (float32)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    image = random_image(120, 90, seed=7)
    resp = _encode(eric, [{"id": "cat", "modality": "image", "url": image_data_url(120, 90, seed=7)}])
    assert resp.status_code == 200, resp.text
    item = resp.json()["items"][0]
    assert item["id"] == "cat" and len(item["hash"]) == 64 and item["dtype"] == "float32"
    assert "placement" not in item  # "grid", left out: the answer Eric gave before the generic path
    fetched = _fetch(eric, item)
    assert fetched.status_code == 200
    ours = load_safetensors(fetched.content)["embedding"]
    assert list(ours.shape) == item["shape"] and ours.shape[0] == item["num_tokens"]

    processor = AutoProcessor.from_pretrained(qwen2_vl_tiny)
    inputs = processor.image_processor(images=[image], return_tensors="pt")
    assert inputs["image_grid_thw"][0].tolist() == item["grid_thw"]
    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_batches_in_flight_keep_every_item_its_own_embedding(eric: EricServer, qwen2_vl_tiny: Path) -> None:
    """Concurrent requests spread over several batches, two in flight at a time: each item's embedding equals
    transformers' for its own image."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    sizes = [[(40 + 11 * i + 5 * k, 56 + 7 * k) for k in range(3)] for i in range(8)]

    def request(i: int) -> httpx.Response:
        return _encode(
            eric,
            [
                {"modality": "image", "url": image_data_url(w, h, seed=600 + 10 * i + k)}
                for k, (w, h) in enumerate(sizes[i])
            ],
        )

    before = _metric_samples(httpx.get(eric.url + "/metrics").text, "eric_batches_total")
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(request, range(8)))
    after = _metric_samples(httpx.get(eric.url + "/metrics").text, "eric_batches_total")
    assert after['modalities="image"'] - before.get('modalities="image"', 0) >= 3  # 24 items, at most 8 a batch
    processor = AutoProcessor.from_pretrained(qwen2_vl_tiny)
    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_tiny, dtype=torch.float32).eval()
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        for k, item in enumerate(r.json()["items"]):
            inputs = processor.image_processor(
                images=[random_image(*sizes[i][k], seed=600 + 10 * i + k)], return_tensors="pt"
            )
            with torch.no_grad():
                ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            torch.testing.assert_close(
                load_safetensors(_fetch(eric, item).content)["embedding"], ref[0], rtol=1e-4, atol=1e-5
            )


def test_same_content_same_hash(eric: EricServer) -> None:
    url = image_data_url(64, 64, seed=3)
    a = _encode(eric, [{"modality": "image", "url": url}, {"modality": "image", "url": url}]).json()["items"]
    png_again = (
        "data:image/png;base64," + __import__("base64").b64encode(image_bytes(random_image(64, 64, seed=3))).decode()
    )
    b = _encode(eric, [{"modality": "image", "url": png_again}]).json()["items"]
    assert a[0]["hash"] == a[1]["hash"] == b[0]["hash"]
    other = _encode(eric, [{"modality": "image", "url": image_data_url(64, 64, seed=4)}]).json()["items"]
    assert other[0]["hash"] != a[0]["hash"]


def test_concurrent_mixed_requests_batch_one_modality(eric: EricServer) -> None:
    def request(i: int) -> httpx.Response:
        if i % 3 == 0:
            items = [{"modality": "video", "url": video_data_url(6, 56 + 8 * (i % 4), 56, seed=i)}]
        else:
            items = [
                {"modality": "image", "url": image_data_url(40 + 17 * k + i, 60 + 9 * k, seed=100 * i + k)}
                for k in range(3)
            ]
            items.append({"modality": "video", "url": video_data_url(4, 64, 48, seed=1000 + i)})
        return _encode(eric, items)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(request, range(24)))
    for r in responses:
        assert r.status_code == 200, r.text
        for item in r.json()["items"]:
            assert item["num_tokens"] == np.prod(item["grid_thw"]) // 4 == item["shape"][0]

    metrics = httpx.get(eric.url + "/metrics").text
    batches = _metric_samples(metrics, "eric_batches_total")
    assert set(batches) == {'modalities="image"', 'modalities="video"'}, batches
    assert batches['modalities="image"'] >= 1 and batches['modalities="video"'] >= 1
    # several requests' items shared batches: fewer image batches than image items
    items = _metric_samples(metrics, "eric_items_total")
    assert items['modality="image",source="encoded"'] > batches['modalities="image"']


def _stage_deltas(before: str, after: str) -> dict[str, tuple[float, float]]:
    """stage -> (count, sum) of eric_stage_seconds gained between two scrapes."""
    out = {}
    for stage in STAGES:
        label = f'stage="{stage}"'
        out[stage] = tuple(
            _metric_samples(after, f"eric_stage_seconds_{part}")[label]
            - _metric_samples(before, f"eric_stage_seconds_{part}")[label]
            for part in ("count", "sum")
        )
    return out


def _gain(before: str, after: str, name: str) -> float:
    """How much an unlabelled sample grew between two scrapes."""

    def value(text: str) -> float:
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    return value(after) - value(before)


def test_stage_timings_and_overhead_are_exported(eric: EricServer) -> None:
    """Every stage of the encode path is timed (engine-side ones travel back in the engine's messages), and the
    per-request overhead beyond the vision tower is exported: counts follow the requests, items and batches sent."""
    before = httpx.get(eric.url + "/metrics").text
    image = image_data_url(48, 72, seed=21)
    requests = [
        [{"modality": "image", "url": image}, {"modality": "image", "url": image_data_url(64, 40, seed=22)}],
        [{"modality": "video", "url": video_data_url(4, 56, 56, seed=23)}],
        [{"modality": "image", "url": image}],
    ]  # still leased: answered from the pool, no engine request; its data: URL is known (the alias): neither
    # fetched (base64-decoded) nor decoded
    wall = 0.0
    for items in requests:
        resp = _encode(eric, items)
        assert resp.status_code == 200, resp.text
        wall += resp.elapsed.total_seconds()
    after = httpx.get(eric.url + "/metrics").text
    gained = _stage_deltas(before, after)
    assert all(total >= 0 for _, total in gained.values()), gained
    counts = {stage: count for stage, (count, _) in gained.items()}
    assert counts == {
        "body_read": 3,
        "fetch": 3,
        "decode": 3,
        "preprocess": 3,
        "hash": 3,
        "pool_reserve": 2,
        "engine_queue": 2,
        "batch_compute": counts["batch_compute"],
        "pool_write": counts["batch_compute"],
        "answer": 3,
    }, gained
    assert counts["batch_compute"] >= 2  # an image batch and a video batch
    for stage in ("fetch", "decode", "preprocess", "hash", "batch_compute", "pool_write"):
        assert gained[stage][1] > 0, (stage, gained[stage])
    # every executed batch reported its forward and pool write once (the whole server's life)
    assert _metric_samples(after, "eric_stage_seconds_count")['stage="batch_compute"'] == sum(
        _metric_samples(after, "eric_batches_total").values()
    )
    overhead = _gain(before, after, "eric_request_overhead_seconds_count")
    overhead_sum = _gain(before, after, "eric_request_overhead_seconds_sum")
    assert overhead == 3 and 0 <= overhead_sum < wall  # less than what the client waited in all


def _closed_port() -> int:
    from eric_epd.stack.process import free_port

    return free_port()


def _bomb_png() -> bytes:
    """A valid PNG header declaring 50000x50000 pixels, with almost no data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 50000, 50000, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _bad_cases(tmp: Path) -> list[tuple[str, object, int, str]]:
    import base64

    def durl(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode()

    png = image_bytes(random_image(64, 64))
    outside = tmp / "outside.png"
    outside.write_bytes(png)
    return [
        ("corrupt bytes", {"items": [{"modality": "image", "url": durl(b"not an image at all")}]}, 400, "image"),
        ("truncated png", {"items": [{"modality": "image", "url": durl(png[: len(png) // 2])}]}, 400, "image"),
        ("zero-size image", {"items": [{"modality": "image", "url": durl(b"")}]}, 400, "empty"),
        ("decompression bomb", {"items": [{"modality": "image", "url": durl(_bomb_png())}]}, 413, "pixels"),
        ("unsupported scheme", {"items": [{"modality": "image", "url": "ftp://example.com/a.png"}]}, 400, "scheme"),
        ("file outside roots", {"items": [{"modality": "image", "url": outside.as_uri()}]}, 403, "file"),
        (
            "unreachable host",
            {"items": [{"modality": "image", "url": f"http://127.0.0.1:{_closed_port()}/a.png"}]},
            400,
            "fetch",
        ),
        ("private host", {"items": [{"modality": "image", "url": "http://10.1.2.3/a.png"}]}, 400, "10.1.2.3"),
        ("oversized body", {"items": [{"modality": "image", "url": durl(b"x" * (2**20))}]}, 413, "body"),
        ("wrong modality", {"items": [{"modality": "audio", "url": durl(png)}]}, 400, "modality"),
        ("video bytes are an image", {"items": [{"modality": "video", "url": durl(png)}]}, 400, "video"),
        ("empty list", {"items": []}, 400, "empty"),
        ("no items field", {"pictures": []}, 400, "items"),
        ("malformed json", b'{"items": [', 400, "JSON"),
    ]


def test_bad_input_gets_4xx_and_server_keeps_serving(eric: EricServer, tmp_path: Path) -> None:
    good = [{"modality": "image", "url": image_data_url(50, 70, seed=11)}]
    for name, body, status, word in _bad_cases(tmp_path):
        if isinstance(body, bytes):
            resp = httpx.post(
                eric.url + "/v1/encode", content=body, headers=eric.headers | {"content-type": "application/json"}
            )
        else:
            resp = httpx.post(eric.url + "/v1/encode", json=body, headers=eric.headers, timeout=30)
        assert resp.status_code == status, (name, resp.status_code, resp.text)
        message = resp.json()["error"]["message"]
        assert word.lower() in message.lower(), (name, message)
        assert _encode(eric, good).status_code == 200, name


def test_missing_embedding_is_404(eric: EricServer) -> None:
    """An unknown hash is a 404 naming it, with or without a lease token (a real token of another entry too)."""
    item = _encode(eric, [{"modality": "image", "url": image_data_url(52, 52, seed=12)}]).json()["items"][0]
    for token in (None, item["handle"]["lease"]):
        headers = eric.headers | ({LEASE_HEADER: token} if token else {})
        resp = httpx.get(eric.url + "/v1/embeddings/" + "0" * 64, headers=headers)
        message = resp.json()["error"]["message"]
        assert resp.status_code == 404 and "no lease" in message and "0" * 64 in message, message
    assert _fetch(eric, item).status_code == 200


def test_file_url_under_root(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """file:// works inside --file-root; the embedding equals the data: URL's (same content, same hash)."""
    png = image_bytes(random_image(80, 60, seed=5))
    (tmp_path / "a.png").write_bytes(png)
    with EricServer(qwen2_vl_tiny, extra_args=("--file-root", str(tmp_path))) as server:
        by_file = _encode(server, [{"modality": "image", "url": (tmp_path / "a.png").as_uri()}])
        by_data = _encode(server, [{"modality": "image", "url": image_data_url(80, 60, seed=5)}])
        assert by_file.status_code == by_data.status_code == 200, by_file.text
        assert by_file.json()["items"][0]["hash"] == by_data.json()["items"][0]["hash"]
        tensor = load_safetensors(_fetch(server, by_file.json()["items"][0]).content)
        assert torch.isfinite(tensor["embedding"]).all()


def test_cpus_pin_every_process_and_size_torch(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """`--cpus` pins the router, the engine and the workers; each worker rank gets its own slice, torch sized to it
    (unpinned, each worker's torch would take every core of the machine)."""
    import os

    import psutil

    last = max(os.sched_getaffinity(0))
    with EricServer(qwen2_vl_tiny, tp=1, log_path=tmp_path / "one.log", extra_args=("--cpus", str(last))) as eric:
        workers = httpx.get(eric.url + "/health").json()["workers"]
        assert [(w["cpus"], w["threads"]) for w in workers] == [([last], 1)]
        tree = [psutil.Process(eric.proc.pid), *psutil.Process(eric.proc.pid).children(recursive=True)]
        assert len(tree) >= 3 and all(p.cpu_affinity() == [last] for p in tree)  # router, engine, worker
        assert _encode(eric, [{"modality": "image", "url": image_data_url(64, 64, seed=3)}]).status_code == 200
    cpus = sorted(os.sched_getaffinity(0))[:2]
    spec = ",".join(map(str, cpus))
    with EricServer(qwen2_vl_tiny, tp=2, log_path=tmp_path / "two.log", extra_args=("--cpus", spec)) as eric:
        workers = httpx.get(eric.url + "/health").json()["workers"]
        expected = [([c], 1) for c in cpus] if len(cpus) == 2 else [(cpus, 1), (cpus, 1)]
        assert [(w["cpus"], w["threads"]) for w in workers] == expected


def test_load_report_for_autoscalers(eric: EricServer) -> None:
    """After a burst of encodes, /v1/load (and /metrics) show the work: items/s, busy time, p99 latency, no queue."""
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda i: _encode(
                    eric, [{"modality": "image", "url": image_data_url(56 + 8 * (i % 3), 56, seed=7000 + i)}]
                ),
                range(12),
            )
        )
    assert all(a.status_code == 200 for a in answers)
    load = httpx.get(eric.url + "/v1/load", headers=eric.headers).json()
    assert load["items_per_s"] > 0 and 0 < load["busy_fraction"] <= 1 and load["p99_encode_s"] > 0, load
    assert load["queue_depth"] == 0 and load["window_s"] > 0
    text = httpx.get(eric.url + "/metrics").text
    for name in ("eric_busy_fraction", "eric_items_per_second", "eric_encode_latency_p99_seconds"):
        assert re.search(rf"^{name} [0-9.e+-]+$", text, re.M), name
    assert httpx.get(eric.url + "/v1/load").status_code == 401  # behind the key, like every route but /health


def _listening(pids: list[int]) -> set[str]:
    """The addresses the processes `pids` accept TCP connections on."""
    return {
        f"{c.laddr.ip}:{c.laddr.port}"
        for pid in pids
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_tp_ranks_listen_only_on_loopback(eric: EricServer) -> None:
    """The router, engine and both TP workers listen on 127.0.0.1 only: the ranks meet through a file in the private
    run directory, not an unauthenticated TCP store. Negative control: the store they met through before binds
    every interface, and the same check sees it."""
    group = psutil.Process(eric.proc.pid)
    pids = [group.pid, *(p.pid for p in group.children(recursive=True))]
    assert len(pids) >= 4 and _listening(pids)  # router, engine, 2 workers (and the port it serves on)
    assert all(a.startswith("127.0.0.1:") for a in _listening(pids)), _listening(pids)
    store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    assert not all(a.startswith("127.0.0.1:") for a in _listening([os.getpid()])), "a TCP store binds every interface"
    del store
