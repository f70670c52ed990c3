"""Mooncake backend: real producer processes (spawn) serving a seeded pool; the test process pulls (TCP, no mocks)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import msgspec
import numpy as np
import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # a checkout without `pip install -e .`; spawned children inherit sys.path
    sys.path.insert(0, _ROOT)

from eric_epd.transfer.backends.base import TransferError  # noqa: E402
from eric_epd.transfer.backends.mooncake import MooncakeConsumer, MooncakeProducer  # noqa: E402
from eric_epd.wire.handles import EmbeddingHandle, MooncakeLocation  # noqa: E402

logger = logging.getLogger(__name__)
CTX = mp.get_context("spawn")
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 3_000_017]  # the last one is not a multiple of anything
SEED = 1234


def _payload(i: int, size: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(SEED + i).bytes(size), dtype=np.uint8)


def _producer_main(sizes: list[int], pool_kind: str, protocol: str, out, ctl) -> None:
    """Fill a pool with region i = _payload(i, sizes[i]), serve it, send the handles, run until told to stop."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    offsets = [sum((s + 4095) // 4096 * 4096 for s in sizes[:i]) for i in range(len(sizes) + 1)]
    shm = None
    if pool_kind == "shm":  # like Eric's pool; unlinked at once so even a killed producer leaks nothing
        shm = SharedMemory(create=True, size=offsets[-1])
        shm.unlink()
        pool = np.frombuffer(shm.buf, dtype=np.uint8)
    else:
        pool = np.empty(offsets[-1], dtype=np.uint8)
    for i, size in enumerate(sizes):
        pool[offsets[i] : offsets[i] + size] = _payload(i, size)
    producer = MooncakeProducer(protocol=protocol)
    producer.register(pool.ctypes.data, pool.nbytes)
    handles = [
        msgspec.msgpack.encode(
            EmbeddingHandle(
                hash=f"h{i}",
                shape=(size,),
                dtype="uint8",
                nbytes=size,
                producer="http://127.0.0.1:9",
                instance_id="test",
                http=f"http://127.0.0.1:9/v1/embeddings/h{i}",
                mooncake=producer.location(offsets[i]),
            )
        )
        for i, size in enumerate(sizes)
    ]
    out.put((os.getpid(), handles))
    ctl.get()
    producer.close()
    del pool
    if shm is not None:
        shm.close()


class _Producer:
    def __init__(self, sizes: list[int], pool_kind: str = "numpy", protocol: str = "tcp") -> None:
        self.out, self.ctl = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=_producer_main, args=(sizes, pool_kind, protocol, self.out, self.ctl))
        self.proc.start()
        self.pid, raw = self.out.get(timeout=60)
        self.handles = [msgspec.msgpack.decode(r, type=EmbeddingHandle) for r in raw]

    def stop(self) -> None:
        if self.proc.is_alive():
            self.ctl.put("stop")
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def quiet_mooncake():
    """Mooncake's glog reads MC_LOG_LEVEL once, when mooncake.engine is first imported (by the first engine)."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("MC_LOG_LEVEL", "ERROR")
        yield


@pytest.fixture(scope="module")
def producer(quiet_mooncake):
    p = _Producer(SIZES, pool_kind="shm")
    yield p
    p.stop()
    assert p.proc.exitcode == 0


@pytest.fixture(scope="module")
def consumer(quiet_mooncake):
    c = MooncakeConsumer()
    yield c
    c.close()
    c.close()  # idempotent


def _fetch(consumer: MooncakeConsumer, handle: EmbeddingHandle) -> np.ndarray:
    dst = np.empty(handle.nbytes, dtype=np.uint8)
    consumer.read(handle, dst)
    return dst


def test_every_size_is_exact(producer, consumer):
    for i, handle in enumerate(producer.handles):
        assert np.array_equal(_fetch(consumer, handle), _payload(i, handle.nbytes)), handle.nbytes
    big = SIZES.index(64 << 20)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _fetch(consumer, producer.handles[big])
        times.append(time.perf_counter() - t0)
    logger.info(
        "mooncake tcp 64 MiB read: best %.2f GB/s, median %.2f GB/s (fresh dst each time)",
        (64 << 20) / min(times) / 1e9,
        (64 << 20) / sorted(times)[1] / 1e9,
    )


def test_into_torch_tensor_and_tiny_staging(producer, quiet_mooncake):
    import torch

    small = MooncakeConsumer(staging_bytes=1 << 20, chunk_bytes=256 << 10)  # four 256 KiB slots
    try:
        for i in (SIZES.index(16 << 20), len(SIZES) - 1, 0):
            handle = producer.handles[i]
            tensor = torch.empty(handle.nbytes, dtype=torch.uint8)
            small.read(handle, tensor.numpy())
            assert np.array_equal(tensor.numpy(), _payload(i, handle.nbytes))
    finally:
        small.close()


def test_sixteen_concurrent_reads(producer, consumer):
    order = [i % len(SIZES) for i in range(16)]
    results: dict[int, object] = {}

    def work(k: int) -> None:
        i = order[k]
        try:
            results[k] = np.array_equal(_fetch(consumer, producer.handles[i]), _payload(i, SIZES[i]))
        except Exception as e:
            results[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(16)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    logger.info("16 concurrent reads (%d MiB) in %.2f s", sum(SIZES[i] for i in order) >> 20, time.perf_counter() - t0)
    assert results == dict.fromkeys(range(16), True)


def test_bad_requests_raise(producer, consumer):
    handle = producer.handles[0]
    loc = handle.mooncake
    assert loc is not None
    outside = msgspec.structs.replace(handle, mooncake=msgspec.structs.replace(loc, addr=4096))
    with pytest.raises(TransferError, match=loc.session_id):
        _fetch(consumer, outside)
    rdma = msgspec.structs.replace(handle, mooncake=msgspec.structs.replace(loc, protocol="rdma"))
    with pytest.raises(TransferError, match="rdma"):
        _fetch(consumer, rdma)
    with pytest.raises(ValueError):
        consumer.read(handle, np.empty(handle.nbytes + 1, dtype=np.uint8))
    assert np.array_equal(_fetch(consumer, handle), _payload(0, handle.nbytes))  # still fine afterwards


def test_rdma_protocol_is_accepted(quiet_mooncake):
    """Without an RDMA NIC the engine falls back to TCP; with one this is a real RDMA loopback read."""
    pool = np.frombuffer(np.random.default_rng(7).bytes(1 << 20), dtype=np.uint8).copy()
    producer, consumer = MooncakeProducer(protocol="rdma"), MooncakeConsumer(protocol="rdma", staging_bytes=1 << 20)
    try:
        producer.register(pool.ctypes.data, pool.nbytes)
        loc = producer.location(4096)
        assert loc.protocol == "rdma" and loc.session_id == producer.session_id and producer.metadata() == b""
        handle = EmbeddingHandle("x", (8192,), "uint8", 8192, "http://p", "i", "http://p/x", mooncake=loc)
        assert np.array_equal(_fetch(consumer, handle), pool[4096 : 4096 + 8192])
    finally:
        consumer.close()
        producer.close()
        producer.close()
    with pytest.raises(TransferError, match="closed"):
        _fetch(consumer, handle)


def test_wide_listeners_are_named(quiet_mooncake, caplog):
    """Mooncake listens on every interface whatever the host: the producer names those ports so they get firewalled."""
    with caplog.at_level(logging.WARNING, logger="eric_epd.transfer.backends.mooncake"):
        producer = MooncakeProducer(host="127.0.0.1")
    try:
        rpc_port = int(producer.session_id.rsplit(":", 1)[1])
        warned = [r.getMessage() for r in caplog.records if "listen on every interface" in r.getMessage()]
        assert len(warned) == 1 and str(rpc_port) in warned[0] and "firewall" in warned[0]
    finally:
        producer.close()


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_dead_producer_fails_fast(quiet_mooncake, how):
    p = _Producer([4096, 1 << 20])
    consumer = MooncakeConsumer(staging_bytes=1 << 20)
    try:
        assert np.array_equal(_fetch(consumer, p.handles[1]), _payload(1, 1 << 20))
        if how == "kill":
            p.proc.kill()
        p.stop()
        assert p.proc.exitcode == (0 if how == "exit" else -signal.SIGKILL)
        session = p.handles[1].mooncake.session_id
        for attempt in range(2):  # the engine's cached session, then a fresh probe
            t0 = time.monotonic()
            with pytest.raises(TransferError, match=session) as err:
                _fetch(consumer, p.handles[1])
            logger.info("read after producer exit #%d: %.3f s: %s", attempt, time.monotonic() - t0, err.value)
            assert time.monotonic() - t0 < 5
        unknown = msgspec.structs.replace(
            p.handles[0], mooncake=MooncakeLocation(session_id="127.0.0.1:1", addr=4096, protocol="tcp")
        )
        with pytest.raises(TransferError, match="unreachable"):
            _fetch(consumer, unknown)
    finally:
        p.stop()
        consumer.close()


def test_frozen_producer_is_bounded(producer, quiet_mooncake):
    """A stopped (SIGSTOP) producer accepts TCP but never answers: reads must still end after timeout_s."""
    frozen = _Producer([4096, 1 << 20])
    warm = MooncakeConsumer(staging_bytes=1 << 20, chunk_bytes=1 << 20, timeout_s=1.0)  # a single slot
    cold = MooncakeConsumer(staging_bytes=1 << 20, timeout_s=1.0)
    try:
        assert np.array_equal(_fetch(warm, frozen.handles[1]), _payload(1, 1 << 20))
        os.kill(frozen.pid, signal.SIGSTOP)
        for name, consumer in (("open session", warm), ("first contact", cold)):
            t0 = time.monotonic()
            with pytest.raises(TransferError, match=frozen.handles[1].mooncake.session_id) as err:
                _fetch(consumer, frozen.handles[1])
            logger.info("frozen producer, %s: failed in %.2f s: %s", name, time.monotonic() - t0, err.value)
            assert time.monotonic() - t0 < 4
        # the abandoned transfer keeps its slot; a replacement serves healthy producers meanwhile
        assert np.array_equal(_fetch(warm, producer.handles[2]), _payload(2, SIZES[2]))
        os.kill(frozen.pid, signal.SIGKILL)  # its sockets close: the abandoned transfer and handshake end
        frozen.proc.join(5)
        t0 = time.monotonic()
        while warm._zombies and time.monotonic() - t0 < 5:
            assert np.array_equal(_fetch(warm, producer.handles[0]), _payload(0, SIZES[0]))  # reaps as it goes
            time.sleep(0.05)
        assert not warm._zombies, "the abandoned staging buffer was not reclaimed"
        assert np.array_equal(_fetch(cold, producer.handles[1]), _payload(1, SIZES[1]))
    finally:
        if frozen.proc.is_alive():
            frozen.proc.kill()
            frozen.proc.join(5)
        warm.close()
        cold.close()


def test_fetcher_says_once_why_it_skips_a_transport(quiet_mooncake, caplog):
    """A consumer whose Mooncake engine uses tcp cannot read an rdma producer: it says so once, counts every skip,
    and the error names the reason (no silent fall-through); its protocol is a consumer setting."""
    from eric_epd.transfer.client import EmbeddingFetcher, MooncakeOptions

    loc = MooncakeLocation(session_id="127.0.0.1:1", addr=4096, protocol="rdma")
    handle = EmbeddingHandle("x" * 64, (8, 4), "float32", 128, "http://p", "i", "http://p/x", mooncake=loc)
    fetcher = EmbeddingFetcher(["mooncake"], mooncake=MooncakeOptions(protocol="tcp"))
    try:
        with caplog.at_level(logging.WARNING, logger="eric_epd.transfer.client"):
            for _ in range(3):
                with pytest.raises(TransferError, match="no usable backend"):
                    fetcher.read_into(handle, np.empty(128, dtype=np.uint8))
        said = [r.getMessage() for r in caplog.records if "skipping a transport" in r.getMessage()]
        assert len(said) == 1 and "over rdma" in said[0] and "uses tcp" in said[0]
        assert fetcher.take_unusable() == 3 and fetcher.take_unusable() == 0
    finally:
        fetcher.close()
