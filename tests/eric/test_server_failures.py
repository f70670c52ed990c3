"""Failure behaviour of a real Eric server: a full queue answers 503, a killed worker fails in-flight requests."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url


def _items(n: int, seed: int) -> list[dict]:
    return [{"modality": "image", "url": image_data_url(64 + 8 * k, 64, seed=seed * 10 + k)} for k in range(n)]


def _post(eric: EricServer, items: list[dict], timeout: float = 60) -> httpx.Response:
    return httpx.post(eric.url + "/v1/encode", json={"items": items}, headers=eric.headers, timeout=timeout)


def test_full_queue_answers_503_with_retry_after(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    with EricServer(qwen2_vl_tiny, extra_args=("--max-queued-items", "3"), log_path=tmp_path / "eric.log") as eric:
        worker = httpx.get(eric.url + "/health").json()["worker_pids"][0]
        os.kill(worker, signal.SIGSTOP)  # nothing finishes while the worker is stopped
        try:
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(_post, eric, _items(3, 1))
                deadline = time.monotonic() + 10
                while "eric_inflight_items 3.0" not in httpx.get(eric.url + "/metrics").text:
                    assert time.monotonic() < deadline, "first request never reached the engine"
                    time.sleep(0.05)
                rejected = _post(eric, _items(1, 2))
                assert rejected.status_code == 503, rejected.text
                assert "queue full" in rejected.json()["error"]["message"]
                assert int(rejected.headers["retry-after"]) >= 1
                os.kill(worker, signal.SIGCONT)
                assert first.result(timeout=30).status_code == 200
        finally:
            os.kill(worker, signal.SIGCONT)
        assert _post(eric, _items(1, 3)).status_code == 200


def test_killed_worker_fails_inflight_requests_and_health(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Two batches in flight (and more queued) when a rank dies: every request gets a 503 within seconds."""
    with EricServer(
        qwen2_vl_tiny,
        tp=2,
        log_path=tmp_path / "eric.log",
        extra_args=("--batches-in-flight", "2", "--max-batch-items", "2"),
    ) as eric:
        assert _post(eric, _items(2, 0)).status_code == 200
        pids = httpx.get(eric.url + "/health").json()["worker_pids"]
        os.kill(pids[1], signal.SIGSTOP)  # requests pile up in flight ...
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_post, eric, _items(2, 10 + i), 30) for i in range(6)]
            time.sleep(1.0)
            assert not any(f.done() for f in futures)
            killed_at = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)  # ... then the worker dies under them
            responses = [f.result(timeout=20) for f in futures]
        assert time.monotonic() - killed_at < 10
        for r in responses:
            assert r.status_code == 503, r.text
            assert "worker rank 1" in r.json()["error"]["message"]
        health = httpx.get(eric.url + "/health", timeout=10)
        assert health.status_code == 503 and "worker rank 1" in health.json()["reason"]
        after = _post(eric, _items(1, 99), timeout=10)
        assert after.status_code == 503


def test_rank_error_with_tp2_fails_fast_not_after_the_worker_timeout(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """A warm-up batch ran on both ranks before Eric said it was healthy. Then rank 1 fails a batch (its address
    space capped, so allocating the batch's pixels raises) while rank 0 waits in an all-reduce rank 1 never joins:
    within seconds (the worker timeout is 120 s) the request gets a 503 naming rank 1's error, /health turns 503,
    and no worker is left blocked."""
    import resource

    with EricServer(qwen2_vl_tiny, tp=2, log_path=tmp_path / "eric.log") as eric:
        # both ranks ran a warm-up batch (their first all-reduce) before /health turned 200
        assert "warm-up batch ran on 2 rank(s)" in (tmp_path / "eric.log").read_text()
        assert _post(eric, _items(1, 0)).status_code == 200
        pids = httpx.get(eric.url + "/health").json()["worker_pids"]
        with open(f"/proc/{pids[1]}/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        resource.prlimit(pids[1], resource.RLIMIT_AS, (vm, vm))  # rank 1 can grow no more
        started = time.monotonic()
        big = [{"modality": "image", "url": image_data_url(224, 224, seed=100 + k)} for k in range(16)]
        failed = _post(eric, big, timeout=200)
        assert time.monotonic() - started < 60
        assert failed.status_code == 503, failed.text
        message = failed.json()["error"]["message"]
        assert "stuck after rank 1" in message and "allocate" in message, message
        health = httpx.get(eric.url + "/health", timeout=10)
        assert health.status_code == 503 and "stuck after rank 1" in health.json()["reason"]
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in pids):
            assert time.monotonic() < deadline, "a worker is still running"
            time.sleep(0.1)
        assert _post(eric, _items(1, 99), timeout=10).status_code == 503


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
