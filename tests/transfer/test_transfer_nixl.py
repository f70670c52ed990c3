"""NIXL backend end to end: a producer process (pool + NixlProducer + metadata over HTTP) and this process reading."""

from __future__ import annotations

import http.server
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # a checkout without `pip install -e .`; spawned children inherit sys.path
    sys.path.insert(0, _ROOT)

from eric_epd.stack.process import new_key  # noqa: E402
from eric_epd.transfer.backends.base import TransferError  # noqa: E402
from eric_epd.transfer.backends.nixl import NixlConsumer, NixlProducer  # noqa: E402
from eric_epd.wire.handles import EmbeddingHandle  # noqa: E402

logger = logging.getLogger(__name__)
CTX = mp.get_context("spawn")
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 1, 100_003]  # the last two: odd sizes
GAP = 123  # regions start at unaligned addresses
KEY = new_key()
"""The producers' API key: like Eric's, their metadata route answers 401 without it."""


def _expected(seed: int, i: int, size: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng([seed, i]).bytes(size), dtype=np.uint8)


def _producer_main(seed: int, q: mp.Queue, stop: mp.Event, api_key: str) -> None:
    """Child: fill a pool, register it, serve the agent metadata over HTTP (to callers with the API key, as Eric
    does), hand out msgspec-encoded handles."""
    pool = np.empty(sum(SIZES) + GAP * (len(SIZES) + 1), dtype=np.uint8)
    offsets, off = [], GAP
    for i, size in enumerate(SIZES):
        pool[off : off + size] = _expected(seed, i, size)
        offsets.append(off)
        off += size + GAP

    producer: NixlProducer | None = None

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {api_key}":
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = producer.metadata()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    base_url = f"http://127.0.0.1:{server.server_address[1]}"
    instance = uuid.uuid4().hex[:12]
    producer = NixlProducer(f"eric-{instance}", f"{base_url}/v1/transfer/nixl/metadata")
    producer.register(pool.ctypes.data, pool.nbytes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handles = [
        EmbeddingHandle(
            hash=f"h{i}",
            shape=(size,),
            dtype="uint8",
            nbytes=size,
            producer=base_url,
            instance_id=instance,
            http=f"{base_url}/v1/embeddings/h{i}",
            nixl=producer.location(offsets[i]),
            lease=f"lease-{i}",
        )
        for i, size in enumerate(SIZES)
    ]
    q.put((os.getpid(), msgspec.msgpack.encode(handles)))
    stop.wait(300)
    producer.close()
    server.shutdown()


class Producer:
    def __init__(self, seed: int) -> None:
        self.seed, self.q, self.stop = seed, CTX.Queue(), CTX.Event()
        self.proc = CTX.Process(target=_producer_main, args=(seed, self.q, self.stop, KEY), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.pid, raw = self.q.get(timeout=1)
                break
            except Exception:
                assert self.proc.is_alive() and time.monotonic() < deadline, "producer did not start"
        self.handles = msgspec.msgpack.decode(raw, type=list[EmbeddingHandle])

    def expected(self, i: int) -> np.ndarray:
        return _expected(self.seed, i, SIZES[i])

    def shutdown(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)
            self.stop.set()
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


@pytest.fixture(scope="module")
def producer():
    p = Producer(seed=1)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def consumer():
    c = NixlConsumer(api_key=KEY)
    yield c
    c.close()
    c.close()


def _read(consumer: NixlConsumer, h: EmbeddingHandle) -> np.ndarray:
    dst = np.empty(h.nbytes, dtype=np.uint8)
    consumer.read(h, dst)
    return dst


def test_reads_are_exact(producer: Producer, consumer: NixlConsumer) -> None:
    for i, h in enumerate(producer.handles):
        assert np.array_equal(_read(consumer, h), producer.expected(i)), SIZES[i]
    import torch

    t = torch.zeros(SIZES[2], dtype=torch.uint8)
    consumer.read(producer.handles[2], t.numpy())  # a view on a tensor's memory
    assert np.array_equal(t.numpy(), producer.expected(2))


def test_16_concurrent_reads(producer: Producer, consumer: NixlConsumer) -> None:
    jobs = [i % len(SIZES) for i in range(32)]
    with ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(lambda i: _read(consumer, producer.handles[i]), jobs))
    for i, out in zip(jobs, outs):
        assert np.array_equal(out, producer.expected(i)), SIZES[i]


def test_throughput_64mib(producer: Producer, consumer: NixlConsumer) -> None:
    h = producer.handles[SIZES.index(64 << 20)]
    dst = np.ones(h.nbytes, dtype=np.uint8)  # pages already faulted in
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        consumer.read(h, dst)
        times.append(time.perf_counter() - t0)
    logger.info("nixl READ 64 MiB: best %.2f GB/s, worst %.2f GB/s", h.nbytes / min(times) / 1e9,
                h.nbytes / max(times) / 1e9)  # fmt: skip
    assert np.array_equal(dst, producer.expected(SIZES.index(64 << 20)))


def test_bad_handles(producer: Producer, consumer: NixlConsumer) -> None:
    h = producer.handles[1]
    loc = h.nixl
    assert loc is not None
    cases = {
        "past the pool": msgspec.structs.replace(h, nixl=msgspec.structs.replace(loc, addr=loc.addr + (1 << 40))),
        "restarted": msgspec.structs.replace(h, nixl=msgspec.structs.replace(loc, agent="eric-old-instance")),
        "no metadata server": msgspec.structs.replace(
            h, nixl=msgspec.structs.replace(loc, agent="eric-gone", metadata_url="http://127.0.0.1:9/md")
        ),
        "no nixl location": msgspec.structs.replace(h, nixl=None),
    }
    for what, bad in cases.items():
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            _read(consumer, bad)
        assert time.monotonic() - t0 < 5, what
        logger.info("%s: %s", what, err.value)
    with pytest.raises(ValueError):
        consumer.read(h, np.empty(h.nbytes + 1, dtype=np.uint8))
    assert np.array_equal(_read(consumer, h), producer.expected(1))  # the failures dropped nothing for good


def test_metadata_needs_the_api_key(producer: Producer) -> None:
    """The metadata fetch carries the consumer's key: without it (or with a wrong one) the producer answers 401 and
    the read fails fast, naming the agent; the keyed consumer reads the same handle."""
    h = producer.handles[1]
    for key in (None, "wrong-" + KEY):
        c = NixlConsumer(api_key=key)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="401") as err:
                _read(c, h)
            assert time.monotonic() - t0 < 5
            assert h.nixl is not None and h.nixl.agent in str(err.value)
        finally:
            c.close()
    keyed = NixlConsumer(api_key=KEY)
    try:
        assert np.array_equal(_read(keyed, h), producer.expected(1))
    finally:
        keyed.close()


def test_killed_producer_fails_fast() -> None:
    p, c = Producer(seed=2), NixlConsumer(api_key=KEY)
    try:
        assert np.array_equal(_read(c, p.handles[2]), p.expected(2))
        p.proc.kill()
        p.proc.join(10)
        for attempt in ("cached connection", "re-fetch"):
            t0 = time.monotonic()
            with pytest.raises(TransferError) as err:
                _read(c, p.handles[3])
            elapsed = time.monotonic() - t0
            logger.info("read after kill (%s): %.3f s: %s", attempt, elapsed, err.value)
            assert elapsed < 5
            assert p.handles[3].nixl.agent in str(err.value)
    finally:
        c.close()
        p.shutdown()


def test_stalled_producer_times_out(producer: Producer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP a stopped producer answers nothing: its read is bounded by transfer_timeout_s, reads from another
    producer proceed meanwhile, and after it resumes the consumer reconnects."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # CMA would still read a stopped process's memory
    p = Producer(seed=3)
    c = NixlConsumer(transfer_timeout_s=2.0, api_key=KEY)
    try:
        assert np.array_equal(_read(c, p.handles[2]), p.expected(2))
        assert np.array_equal(_read(c, producer.handles[2]), producer.expected(2))
        os.kill(p.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            stuck = ex.submit(_read, c, p.handles[3])
            time.sleep(0.2)
            assert np.array_equal(_read(c, producer.handles[3]), producer.expected(3))
            other = time.monotonic() - t0
            with pytest.raises(TransferError, match="not done after") as err:
                stuck.result()
            elapsed = time.monotonic() - t0
        logger.info("read from a stopped producer: %.3f s: %s; meanwhile another read done at %.3f s",
                    elapsed, err.value, other)  # fmt: skip
        assert other < 1.5 < elapsed < 4
        os.kill(p.pid, signal.SIGCONT)
        assert np.array_equal(_read(c, p.handles[4]), p.expected(4))  # re-fetched the metadata, reconnected
    finally:
        c.close()
        p.shutdown()


def test_process_with_an_agent_exits_cleanly() -> None:
    """nixl's bundled rdma-core next to the system's verbs providers crashed at exit (SIGSEGV in libnl's
    destructors); a process that used a consumer agent must exit with status 0. The UCX setting that prevents it
    is scoped to the agent's creation: the process environment is left as it was (other UCX users, children)."""
    code = (
        "import os\nfrom eric_epd.transfer.backends.nixl import NixlConsumer\n"
        "c = NixlConsumer()\nc.close()\nprint('closed', os.environ.get('UCX_MODULES'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1:] == ["closed None"], done.stderr
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
