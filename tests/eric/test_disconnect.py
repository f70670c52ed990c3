"""A client that disconnects from a real Eric (or from a gateway in front of two) cancels its work: finished items
nobody else holds are freed, items another live request waits for stay, and pool space is freed only after the engine
answered."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors

from eric_epd.stack.process import ServerProcess, free_port
from eric_epd.stack.servers import EricServer, GatewayServer
from eric_epd.testing.media import data_url, image_bytes, image_data_url, random_image
from eric_epd.testing.stack import image_messages
from tests.support.helpers_servers import post_raw as _post_raw
from tests.support.helpers_servers import stopped as _stopped
from tests.support.placement import rendezvous_first

ERIC_KEY = "eric-disconnect-test"
_ABORTED = 'eric_requests_total{status="499"}'
GATEWAY_KEY = "sk-disconnect-test"


# ---------------------------------------------------------------- a real Eric


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    log = tmp_path_factory.mktemp("eric-disconnect") / "eric.log"
    with EricServer(qwen2_vl_tiny, log_path=log, api_key=ERIC_KEY, extra_args=("--max-batch-items", "4")) as server:
        yield server


def _jpeg_url(width: int, height: int, seed: int) -> str:
    return data_url(image_bytes(random_image(width, height, seed), "JPEG"), "image/jpeg")


def _encode_body(urls: list[str]) -> dict:
    return {"items": [{"modality": "image", "url": u} for u in urls]}


def _pool(eric: EricServer) -> dict:
    return httpx.get(eric.url + "/v1/transfer", headers=eric.headers, timeout=10).json()


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_until(what: str, check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def _assert_drained(eric: EricServer, timeout_s: float = 60.0) -> None:
    """Pool back to zero held bytes and entries, engine queue empty; far sooner than the 300 s TTL."""

    def drained() -> bool:
        pool, health = _pool(eric), httpx.get(eric.url + "/health", timeout=10)
        return (
            pool["used_bytes"] == 0
            and pool["entries"] == 0
            and health.status_code == 200
            and health.json()["queued_items"] == 0
            and health.json()["running_items"] == 0
        )

    try:
        _wait_until("the pool and the engine queue are empty", drained, timeout_s)
    finally:
        pool = _pool(eric)
    assert pool["used_bytes"] == 0 and pool["entries"] == 0, pool
    assert _metric(eric, "eric_inflight_items") == 0


def _worker(eric: EricServer) -> int:
    return httpx.get(eric.url + "/health", timeout=10).json()["worker_pids"][0]


def _fetch(eric: EricServer, handle: dict) -> bytes:
    resp = httpx.get(handle["http"], headers={**eric.headers, "X-Eric-Lease": handle.get("lease", "")}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.content


def _ack(eric: EricServer, handle: dict) -> None:
    resp = httpx.post(
        f"{eric.url}/v1/embeddings/{handle['hash']}/ack",
        json={},
        headers={**eric.headers, "X-Eric-Lease": handle.get("lease", "")},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text


def _encode(eric: EricServer, urls: list[str]) -> list[dict]:
    resp = httpx.post(eric.url + "/v1/encode", json=_encode_body(urls), headers=eric.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["items"]


def test_disconnect_storm_frees_the_pool(eric: EricServer) -> None:
    """Six requests of 40 images (up to the model's largest size), each abandoned 0.1-0.6 s after it was sent (20
    images shared by all, in different orders, 20 of their own), while the worker is stopped so that none can be
    answered first (unstopped, Eric encodes such a request in about 0.2 s): nothing stays held, and the server then
    answers a normal request correctly."""
    shared = [image_data_url(56 + 8 * k, 224, seed=7000 + k) for k in range(20)]
    bodies = [
        _encode_body(
            shared[s * 3 :]
            + shared[: s * 3]
            + [image_data_url(224 - 8 * k, 64, seed=7100 + 20 * s + k) for k in range(20)]
        )
        for s in range(6)
    ]
    rng = random.Random(1234)
    aborted = _metric(eric, _ABORTED)

    def abandon(body: dict) -> None:
        sock = _post_raw(eric.port, "/v1/encode", body, eric.headers)
        time.sleep(rng.uniform(0.1, 0.6))
        sock.close()

    with _stopped(_worker(eric)):
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(abandon, bodies))
        _wait_until("the router saw every disconnect", lambda: _metric(eric, _ABORTED) - aborted == 6)
    _assert_drained(eric)
    assert _metric(eric, _ABORTED) - aborted == 6  # none of them was answered

    [item] = _encode(eric, [image_data_url(120, 90, seed=7)])
    embedding = load_safetensors(_fetch(eric, item["handle"]))["embedding"]
    assert list(embedding.shape) == item["shape"] and embedding.shape[0] == item["num_tokens"]
    assert np.isfinite(embedding).all()
    _ack(eric, item["handle"])
    _assert_drained(eric)


def test_space_held_until_the_engine_answers(eric: EricServer) -> None:
    """Clients leave while their items sit in the engine behind a running batch (its worker stopped): the pool
    space stays reserved (the worker may still write there) until the engine answers the aborts, then all of it
    is freed and the queue is empty."""
    worker = _worker(eric)
    bodies = [
        _encode_body([image_data_url(96 + 8 * k, 80, seed=7200 + 10 * r + k) for k in range(6)]) for r in range(4)
    ]
    aborted = _metric(eric, _ABORTED)
    with _stopped(worker):
        sockets = [_post_raw(eric.port, "/v1/encode", body, eric.headers) for body in bodies]
        _wait_until("every item reached the engine", lambda: _metric(eric, "eric_inflight_items") == 24)
        for sock in sockets:
            sock.close()
        _wait_until("the router saw every disconnect", lambda: _metric(eric, _ABORTED) - aborted == 4)
        held = _pool(eric)
        assert held["entries"] == 24 and held["used_bytes"] > 0, held  # not freed under a running batch
    _assert_drained(eric)


def test_shared_item_stays_for_the_live_request(eric: EricServer) -> None:
    """A client leaves while another live request waits for one of its images: the live request still gets that
    embedding, reads it with its own lease, and it equals a fresh encode of the same image."""
    worker = _worker(eric)
    shared = image_data_url(112, 84, seed=7300)
    mine = [image_data_url(96 + 8 * k, 72, seed=7310 + k) for k in range(5)]
    own = image_data_url(100, 76, seed=7320)
    aborted = _metric(eric, _ABORTED)
    with ThreadPoolExecutor(1) as pool, _stopped(worker):
        hostile = _post_raw(eric.port, "/v1/encode", _encode_body([shared, *mine]), eric.headers)
        _wait_until("the hostile request reached the engine", lambda: _metric(eric, "eric_inflight_items") == 6)
        live = pool.submit(_encode, eric, [shared, own])
        # the live request waits for `shared` (it registers before it submits `own`, which bumps the gauge)
        _wait_until("the live request reached the engine", lambda: _metric(eric, "eric_inflight_items") == 7)
        hostile.close()
        _wait_until("the router saw the disconnect", lambda: _metric(eric, _ABORTED) - aborted == 1)
    items = live.result(timeout=120)
    assert len(items) == 2 and items[0]["hash"] != items[1]["hash"]
    kept = _fetch(eric, items[0]["handle"])
    held = _pool(eric)
    assert held["entries"] == 2, held  # the hostile request's other five are gone already
    for item in items:
        _ack(eric, item["handle"])
    _assert_drained(eric)
    [fresh] = _encode(eric, [shared])
    assert fresh["hash"] == items[0]["hash"] and _fetch(eric, fresh["handle"]) == kept
    _ack(eric, fresh["handle"])
    _assert_drained(eric)


# ---------------------------------------------------------------- through the gateway


def _images_for(target: EricServer, erics: list[EricServer], seed: int, count: int) -> list[str]:
    found: list[str] = []
    while len(found) < count:
        url = image_data_url(72 + seed % 40, 64, seed=seed)
        if rendezvous_first(url, [e.url for e in erics]) == target.url:
            found.append(url)
        seed += 1
    return found


def test_gateway_client_disconnect_frees_both_erics(eric: EricServer, qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """EPD requests whose images are split over two Erics; one Eric has answered, the other is busy (worker
    stopped). The gateway's clients leave: the gateway gives back the answered items' leases and cancels its call to
    the busy Eric, which drops that work. Both pools end empty."""
    with EricServer(qwen2_vl_tiny, log_path=tmp_path / "eric-b.log", api_key=ERIC_KEY) as busy:
        erics = [eric, busy]
        dead_upstream = f"http://127.0.0.1:{free_port()}"  # never reached: every client leaves during the encode
        gateway = GatewayServer(
            tmp_path / "gateway.log",
            "--encoder-urls",
            f"{eric.url},{busy.url}",
            "--colocated-urls",
            dead_upstream,
            "--api-key",
            GATEWAY_KEY,
            "--epd-min-items",
            "2",
            "--health-interval",
            "3600",  # no load reports: placement by rendezvous alone
            eric_api_key=ERIC_KEY,
        )
        with gateway, _stopped(_worker(busy)):
            requests = [
                _images_for(eric, erics, 8000 + 100 * r, 2) + _images_for(busy, erics, 8050 + 100 * r, 2)
                for r in range(4)
            ]
            answered_before = _metric(eric, 'eric_requests_total{status="200"}')
            sockets = [
                _post_raw(
                    gateway.port,
                    "/v1/chat/completions",
                    {"model": "m", "messages": image_messages(urls), "max_tokens": 4},
                    {"Authorization": f"Bearer {GATEWAY_KEY}"},
                )
                for urls in requests
            ]
            _wait_until(
                "one Eric answered its half and the other holds its half in the engine",
                lambda: (
                    _metric(eric, 'eric_requests_total{status="200"}') - answered_before == 4
                    and _metric(busy, "eric_inflight_items") == 8
                ),
            )
            assert _pool(eric)["entries"] == 8  # leased to the gateway, which will never use them now
            for sock in sockets:
                sock.close()
            _wait_until("the gateway gave back the answered items", lambda: _pool(eric)["entries"] == 0)
            _wait_until("the busy Eric saw its caller leave", lambda: _metric(busy, _ABORTED) == 4)
        _assert_drained(eric)
        _assert_drained(busy)
