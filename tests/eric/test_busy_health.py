"""Busy is not dead, against a real Eric and gateway: while a batch keeps Eric's engine from answering (its worker
stopped mid-batch, as a long batch on a slow tower would), /health stays 200 "busy", the gateway keeps the Eric and
/ready says whether it admits more; a hung engine loop (the engine process stopped) turns /health 503 after
--liveness-timeout, the gateway ejects the Eric and readmits it once it runs again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from eric_epd.stack.servers import EricServer, GatewayServer
from eric_epd.testing.media import image_data_url

LIVENESS_S = 3.0


def _items(n: int, seed: int) -> list[dict]:
    return [{"modality": "image", "url": image_data_url(64 + 8 * k, 64, seed=seed * 10 + k)} for k in range(n)]


def _post(eric: EricServer, items: list[dict]) -> httpx.Response:
    return httpx.post(eric.url + "/v1/encode", json={"items": items}, headers=eric.headers, timeout=60)


def _until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_long_batch_is_busy_and_a_hung_engine_is_dead(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    admin = {"Authorization": "Bearer admin-key"}
    with (
        EricServer(
            qwen2_vl_tiny,
            log_path=tmp_path / "eric.log",
            extra_args=("--liveness-timeout", str(LIVENESS_S), "--max-queued-items", "2"),
        ) as eric,
        GatewayServer(
            tmp_path / "gateway.log",
            "--encoder-urls",
            eric.url,
            "--colocated-urls",
            "http://127.0.0.1:9",
            "--eject-after-failures",
            "2",
            eric_api_key=eric.api_key,
            admin_key="admin-key",
        ) as gateway,
    ):

        def kept() -> bool:
            return httpx.get(gateway.url + "/health", headers=admin).json()["encoders"][eric.url]

        idle = httpx.get(eric.url + "/health")
        assert idle.status_code == 200 and idle.json()["status"] == "ok", idle.text
        engine, worker = idle.json()["engine_pid"], idle.json()["worker_pids"][0]
        assert httpx.get(eric.url + "/ready").json() == {"status": "ready"}

        os.kill(worker, signal.SIGSTOP)  # the batch it is handed does not finish: a long batch
        try:
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(_post, eric, _items(2, 1))
                _until(
                    "the request never reached the engine",
                    lambda: "eric_inflight_items 2.0" in httpx.get(eric.url + "/metrics").text,
                    10,
                )
                ready = httpx.get(eric.url + "/ready")
                assert ready.status_code == 503 and "queue full" in ready.json()["reason"], ready.text
                watched_until = time.monotonic() + 2 * LIVENESS_S  # past the liveness timeout and many probes
                while time.monotonic() < watched_until:
                    health = httpx.get(eric.url + "/health", timeout=2)
                    assert health.status_code == 200 and health.json()["status"] == "busy", health.text
                    assert kept(), "the gateway ejected a busy Eric"
                    time.sleep(0.3)
                assert not first.done()  # the engine was busy all along: it never answered a status
                os.kill(worker, signal.SIGCONT)
                assert first.result(timeout=30).status_code == 200
        finally:
            os.kill(worker, signal.SIGCONT)
        _until("not ready again after the batch", lambda: httpx.get(eric.url + "/ready").status_code == 200, 5)

        os.kill(engine, signal.SIGSTOP)  # the engine's loop hangs: dead, though every process exists
        try:
            stopped = time.monotonic()
            _until(
                "a hung engine stayed healthy",
                lambda: httpx.get(eric.url + "/health").status_code == 503,
                LIVENESS_S + 5,
            )
            assert time.monotonic() - stopped >= LIVENESS_S - 0.5  # not before its heartbeat is that old
            dead = httpx.get(eric.url + "/health").json()
            assert dead["status"] == "unhealthy" and "engine silent" in dead["reason"], dead
            assert httpx.get(eric.url + "/ready").status_code == 503
            _until("the gateway kept a dead Eric", lambda: not kept(), 10)
        finally:
            os.kill(engine, signal.SIGCONT)
        _until("the engine never came back", lambda: httpx.get(eric.url + "/health").status_code == 200, 10)
        _until("the gateway never readmitted it", kept, 10)
        assert _post(eric, _items(1, 9)).status_code == 200
