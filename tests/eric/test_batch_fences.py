"""A region is reused only after every writer and reader of it ended. With two batches in flight, a request whose
first batch fails is answered only once its second batch has ended (its finished items committed with the error), so
the router frees none of its regions under a running batch; a concurrent request keeps exactly a clean run's bytes
and the pool drains to 0. A global-cache put keeps its region past the TTL and past a cancellation until the store's
copy returns."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from eric_epd.eric.config import BatchLimits
from eric_epd.runtime.engine.engine import Engine
from eric_epd.runtime.executor.worker import TEST_FAULT_ENV
from eric_epd.runtime.work import Batch, BatchFailedError, BatchOutput
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url
from eric_epd.testing.pools import wait_pool_drained
from eric_epd.testing.stack import metric, wait_for
from eric_epd.transfer.global_cache import GlobalCache
from eric_epd.transfer.pool import EmbeddingPool
from tests.support.helpers_engine import WORKLOAD as _WORKLOAD
from tests.support.helpers_engine import InstantExecutor
from tests.support.helpers_engine import work_request as _request
from tests.support.helpers_servers import read_and_ack as _read_and_ack

# ---------------------------------------------------------------- engine protocol (no processes)


class _FailingExecutor(InstantExecutor):
    """Runs batches instantly, failing those whose id is in `fail`; records submissions and collections."""

    def __init__(self, fail: set[int]) -> None:
        self.fail = fail
        self.events: list[tuple[str, int]] = []

    def submit(self, batch: Batch) -> None:
        self.events.append(("submit", batch.batch_id))

    def collect(self, batch: Batch) -> BatchOutput:
        self.events.append(("collect", batch.batch_id))
        if batch.batch_id in self.fail:
            raise BatchFailedError("the model rejected it")
        return super().collect(batch)


def test_engine_answers_a_failed_request_only_after_its_batch_in_flight() -> None:
    executor = _FailingExecutor({0})
    engine = Engine(BatchLimits(max_items=2, max_patches=4096, in_flight=2), executor, _WORKLOAD.validate)
    assert engine.add_request(*_request("a", ["a0", "a1", "a2", "a3"])) == []
    assert engine.add_request(*_request("b", ["b0", "b1"])) == []
    assert engine.step() == []  # batch 0 failed, but batch 1 (a2, a3) is still in flight: no answer yet
    assert executor.events == [("submit", 0), ("submit", 1), ("collect", 0)]
    [(failed, _)] = engine.step()  # batch 1 ended: now a is answered, with what it wrote
    assert executor.events[-2:] == [("submit", 2), ("collect", 1)]
    assert (failed.request_id, failed.status) == ("a", 500) and "the model rejected it" in failed.error
    assert [r.key for r in failed.items] == ["a2", "a3"]
    [(answer, _)] = engine.step()
    assert answer.request_id == "b" and answer.error is None and [r.key for r in answer.items] == ["b0", "b1"]
    status = engine.status()
    assert (status.queued_items, status.running_items, engine.has_work) == (0, 0, False)


def test_engine_drops_a_failed_requests_queued_items_and_waits_for_its_running_ones() -> None:
    executor = _FailingExecutor({0})
    engine = Engine(BatchLimits(max_items=1, max_patches=4096, in_flight=2), executor, _WORKLOAD.validate)
    engine.add_request(*_request("a", ["a0", "a1", "a2"]))
    assert engine.step() == []  # a0 failed; a1 runs, a2 is dropped from the queue
    [(failed, _)] = engine.step()
    assert failed.status == 500 and [r.key for r in failed.items] == ["a1"]
    assert executor.events == [("submit", 0), ("submit", 1), ("collect", 0), ("collect", 1)]
    assert engine.step() == [] and not engine.has_work


# ---------------------------------------------------------------- a real Eric, its first batch failing


def _items(seeds: list[int]) -> list[dict]:
    return [{"modality": "image", "url": image_data_url(64 + 8 * (s % 3), 64, seed=s)} for s in seeds]


def _post(eric: EricServer, items: list[dict]) -> httpx.Response:
    return httpx.post(eric.url + "/v1/encode", json={"items": items}, headers=eric.headers, timeout=120)


def _embeddings(eric: EricServer, resp: httpx.Response) -> list[bytes]:
    assert resp.status_code == 200, resp.text
    return [_read_and_ack(eric, item) for item in resp.json()["items"]]


_A = [11, 12, 13, 14]  # one request, two batches of two
_B = [21, 22]  # a concurrent request, the batch after them


def _scenario(eric: EricServer) -> tuple[httpx.Response, httpx.Response]:
    """With the worker stopped, A's four items reach the engine (two batches in flight), then B's two; the worker
    then runs them in that order. Returns A's and B's answers."""
    worker = httpx.get(eric.url + "/health", timeout=10).json()["worker_pids"][0]
    os.kill(worker, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            a: Future[httpx.Response] = pool.submit(_post, eric, _items(_A))
            assert wait_for(lambda: metric(eric.url, "eric_inflight_items") == 4), "A never reached the engine"
            b = pool.submit(_post, eric, _items(_B))
            assert wait_for(lambda: metric(eric.url, "eric_inflight_items") == 6), "B never reached the engine"
            os.kill(worker, signal.SIGCONT)
            return a.result(timeout=120), b.result(timeout=120)
    finally:
        os.kill(worker, signal.SIGCONT)


def test_a_failed_batch_answers_only_after_the_requests_other_batch(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Batch 0 (A's first two items) fails in the worker while batch 1 (A's other two) is in flight: A's 500 comes
    with batch 1's items committed (they are served from the pool afterwards, not encoded again: batch 1 had ended
    before the answer), B gets exactly a clean run's bytes, the pool drains to 0, and A's content is then served
    with a clean run's bytes."""
    args = ("--batches-in-flight", "2", "--max-batch-items", "2", "--keep-acked-bytes", str(8 << 20))
    with EricServer(qwen2_vl_tiny, extra_args=args, log_path=tmp_path / "clean.log") as clean:
        a, b = _scenario(clean)
        clean_a, clean_b = _embeddings(clean, a), _embeddings(clean, b)
    assert len(set(clean_a + clean_b)) == 6

    with EricServer(
        qwen2_vl_tiny, extra_args=args, env={TEST_FAULT_ENV: "0"}, log_path=tmp_path / "faulty.log"
    ) as eric:
        a, b = _scenario(eric)
        assert a.status_code == 500, a.text
        assert "test fault: batch 0 fails" in a.json()["error"]["message"]
        assert _embeddings(eric, b) == clean_b
        wait_pool_drained(eric.url, eric.headers)

        cached = metric(eric.url, 'eric_items_total{modality="image",source="cached"}')
        second = _post(eric, _items(_A[2:]))  # batch 1's items: written before A was answered, so committed
        assert _embeddings(eric, second) == clean_a[2:]
        assert metric(eric.url, 'eric_items_total{modality="image",source="cached"}') == cached + 2
        again = _post(eric, _items(_A))  # the failed batch's content, encoded anew
        assert _embeddings(eric, again) == clean_a
        assert "batch 0 failed" in (tmp_path / "faulty.log").read_text()
        stats = wait_pool_drained(eric.url, eric.headers)
        assert (stats["used_bytes"], stats["entries"]) == (0, 0)


def _exited(pid: int) -> bool:
    """The process has exited (gone, or a zombie nobody reaped yet): it runs no more code."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_dead_engine_fails_requests_only_once_its_workers_are_gone(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """The engine process is killed while its worker holds a batch (stopped mid-batch: it would write the batch's
    regions when it runs on): the router kills the orphaned worker and answers the request's 503 only once the worker
    has exited, so no region it could still write is handed out again; held bytes return to 0."""
    with EricServer(qwen2_vl_tiny, log_path=tmp_path / "eric.log") as eric:
        assert len(_embeddings(eric, _post(eric, _items([1])))) == 1
        worker = httpx.get(eric.url + "/health", timeout=10).json()["worker_pids"][0]
        with open(f"/proc/{worker}/stat") as f:
            engine = int(f.read().rsplit(")", 1)[1].split()[1])  # the worker's parent
        os.kill(worker, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(_post, eric, _items([5, 6]))
                assert wait_for(lambda: metric(eric.url, "eric_inflight_items") == 2), "never reached the engine"
                os.kill(engine, signal.SIGKILL)
                answer = pending.result(timeout=60)
                assert _exited(worker), "the request was answered while its worker could still write"
        finally:
            if not _exited(worker):
                os.kill(worker, signal.SIGKILL)
        assert answer.status_code == 503 and "engine process died" in answer.json()["error"]["message"], answer.text
        stats = wait_pool_drained(eric.url, eric.headers)
        assert (stats["used_bytes"], stats["entries"]) == (0, 0)
        assert httpx.get(eric.url + "/health", timeout=10).status_code == 503
        assert _post(eric, _items([7])).status_code == 503  # still serving: a clear error, not a hang


# ---------------------------------------------------------------- global-cache puts


class _BlockedStore:
    """A store whose put_from blocks until `release` is set, recording the bytes it copied then."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.copied: bytes = b""

    def put_from(self, key: str, addr: int, nbytes: int) -> int:
        self.started.set()
        self.release.wait(60)
        self.copied = ctypes.string_at(addr, nbytes)
        return 0


def test_a_put_in_flight_keeps_its_region_fenced_past_the_ttl() -> None:
    pool = EmbeddingPool(f"eric-test-{time.monotonic_ns()}", 1 << 16, ttl_s=0.0)
    try:
        entry = pool.reserve("k", 512, (128, 1), "float32")
        assert entry is not None
        pool.commit("k")
        pool.lease("k")
        hold = pool.hold(entry, "store-put")  # a put copies it out
        assert pool.expire(now=time.monotonic() + 3600) == ["k"] and pool.get("k") is None
        assert pool.reserve("other", 1 << 16, (1,), "uint8") is None  # the region is not handed out under the put
        assert pool.used_bytes == 512 and pool.audit() is None
        hold.end()
        assert pool.used_bytes == 0 and pool.audit() is None
    finally:
        pool.close()


def test_a_cancelled_put_returns_only_once_the_store_let_go_of_the_region() -> None:
    async def run() -> None:
        region = np.arange(256, dtype=np.uint8)
        store = _BlockedStore()
        cache = GlobalCache("127.0.0.1:1", "127.0.0.1", 1 << 20, region, "float32")
        cache._store = store  # joined
        put = asyncio.create_task(cache.write("k", region))
        await asyncio.to_thread(store.started.wait, 30)
        put.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not put.done()  # the copy still reads the region: the caller must not free it yet
        store.release.set()
        try:
            await put
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the cancellation was lost")
        assert store.copied == region.tobytes()

    asyncio.run(run())
