"""Tests for eric_epd.executor.shm_broadcast: real reader processes (spawn), CPU only."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # a checkout without `pip install -e .`; spawned children inherit sys.path
    sys.path.insert(0, _ROOT)

from eric_epd.executor.shm_broadcast import (  # noqa: E402
    BroadcastAborted,
    BroadcastClosed,
    BroadcastHandle,
    ShmBroadcast,
    buffer_to_tensor,
    tensor_to_buffer,
)

logger = logging.getLogger(__name__)
CTX = mp.get_context("spawn")
SHM_DIR = Path("/dev/shm")
PREFIX = f"ebc_{os.getpid():x}_"  # default names of every segment this (writer) process creates

N_MSGS, SLOT = 200, 1 << 20
SPILL_AT = {3, 57, 58, 121, 199}  # messages with one buffer larger than the slot


def _segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = _segments()
    yield
    assert _segments() - before == set(), "shared memory segments leaked"


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(5)


def _start(procs: list, target, *args) -> None:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)


def _any_dead(procs: list):
    return lambda: not all(p.is_alive() for p in procs)


def _message(i: int) -> tuple[bytes, list]:
    """Deterministic message i: 0-4 buffers of assorted types/sizes (incl. empty), header with CRCs."""
    rng = np.random.default_rng(i)
    bufs: list = []
    for j in range(int(rng.integers(0, 5))):
        r = rng.random()
        size = 0 if r < 0.2 else int(rng.integers(1, 4096)) if r < 0.7 else int(rng.integers(4096, 300_000))
        raw = rng.integers(0, 256, size, dtype=np.uint8)
        bufs.append([raw, raw.tobytes(), memoryview(raw), raw[: size // 4 * 4].view(np.float32), raw[::2]][j])
    if i in SPILL_AT:
        bufs.append(rng.integers(0, 256, int(rng.integers(SLOT + 1, 3 * SLOT)), dtype=np.uint8))
    flat = [np.ascontiguousarray(np.asarray(memoryview(b))).tobytes() for b in bufs]
    meta = {"i": i, "lens": [len(f) for f in flat], "crc": [zlib.crc32(f) for f in flat]}
    return msgspec.msgpack.encode(meta), bufs


def _check(i: int, header: bytes, bufs: list) -> str | None:
    meta = msgspec.msgpack.decode(header)
    got = {"i": i, "lens": [len(b) for b in bufs], "crc": [zlib.crc32(b) for b in bufs]}
    return None if meta == got else f"message {i}: expected {meta}, got {got}"


def _reader_main(handle_raw: bytes, rank: int, n_msgs: int, mode: str, out, busy_s: float = 1.0) -> None:
    reader = ShmBroadcast.attach(msgspec.msgpack.decode(handle_raw, type=BroadcastHandle), rank, busy_s=busy_s)
    ok, errors = 0, []
    try:
        for i in range(n_msgs):
            if mode == "copy":
                header, bufs = reader.dequeue_copy(timeout=20)
                err = _check(i, header, bufs)
            elif mode == "ctx":
                with reader.receive(timeout=20) as (header, views):
                    err = _check(i, header, views)
            else:
                header, views = reader.dequeue(timeout=20)
                err = _check(i, header, views)
                reader.release()
            ok += err is None
            errors += [err] if err else []
    except Exception as e:
        errors.append(repr(e))
    finally:
        reader.close()
    out.put((rank, ok, errors))


@pytest.mark.parametrize("busy_s", [1.0, 0.0], ids=["polling", "blocking-on-pings"])
def test_three_readers_200_random_messages(procs, busy_s):
    """busy_s=0: every wait of every reader blocks on the writer's pings (stale ones included) instead of polling."""
    writer = ShmBroadcast.create(3, n_slots=4, slot_bytes=SLOT)
    q = CTX.Queue()
    for rank, mode in enumerate(("views", "ctx", "copy")):
        _start(procs, _reader_main, msgspec.msgpack.encode(writer.handle()), rank, N_MSGS, mode, q, busy_s)
    try:
        for i in range(N_MSGS):
            header, bufs = _message(i)
            writer.enqueue(header, bufs, timeout=20, should_abort=_any_dead(procs))
        results = sorted(q.get(timeout=30) for _ in procs)
        assert len(_segments()) <= 1 + writer.n_slots  # main + at most one spill per slot, never more
    except BroadcastAborted:
        pytest.fail(f"a reader exited early: {[q.get(timeout=5) for p in procs if not p.is_alive()]}")
    finally:
        writer.close()
    assert results == [(rank, N_MSGS, []) for rank in range(3)]
    assert writer.n_spilled == len(SPILL_AT)


def _tensors(seed: int, small_only: bool):
    import torch

    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3e38, -1.5])
    out = [
        special, special.to(torch.bfloat16), torch.tensor(2.5, dtype=torch.bfloat16),
        torch.empty(0, 16, dtype=torch.bfloat16), torch.randn(64, 48, generator=g).to(torch.bfloat16).t(),
        torch.randn(3, 224, 224, generator=g),  # float32 pixels, 588 KiB
    ]
    if not small_only:  # bfloat16 activations (1.1 MiB) + 4 MiB: the message spills
        out += [torch.randn(577, 1024, generator=g).bfloat16(), torch.randn(2 << 20, generator=g).bfloat16()]
    return out


def _tensor_reader_main(handle: BroadcastHandle, rank: int, n_msgs: int, out) -> None:
    import torch

    reader = ShmBroadcast.attach(handle, rank)
    errors = []
    for _ in range(n_msgs):
        with reader.receive(timeout=30) as (header, views):
            meta = msgspec.msgpack.decode(header)
            want = _tensors(meta["seed"], meta["small_only"])
            for k, (view, (dtype, shape), w) in enumerate(zip(views, meta["specs"], want, strict=True)):
                t = buffer_to_tensor(view, dtype, shape)
                same = t.dtype == w.dtype and t.shape == w.shape and torch.equal(
                    t.reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8))
                zero_copy = t.numel() == 0 or t.data_ptr() == np.frombuffer(view, np.uint8).ctypes.data
                if not (same and zero_copy):
                    errors.append(f"seed {meta['seed']} tensor {k}: {dtype}{shape} {same=} {zero_copy=}")
    reader.close()
    out.put((rank, errors))


def test_tensors_round_trip_bitwise(procs):
    writer = ShmBroadcast.create(2, n_slots=2, slot_bytes=2 << 20)
    q, plan = CTX.Queue(), [(seed, seed % 2 == 1) for seed in range(4)]
    for rank in range(2):
        _start(procs, _tensor_reader_main, writer.handle(), rank, len(plan), q)
    try:
        for seed, small_only in plan:
            ts = _tensors(seed, small_only)
            specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in ts]
            header = msgspec.msgpack.encode({"seed": seed, "small_only": small_only, "specs": specs})
            writer.enqueue(header, ts, timeout=30, should_abort=_any_dead(procs))
        assert sorted(q.get(timeout=30) for _ in procs) == [(0, []), (1, [])]
        assert writer.n_spilled == 2
    finally:
        writer.close()


def _stalling_reader_main(handle: BroadcastHandle, rank: int, out) -> None:
    reader = ShmBroadcast.attach(handle, rank)
    reader.dequeue_copy(timeout=30)
    out.put(("read one", rank))
    time.sleep(60)  # never releases another message; the test kills us


def _reader_until_closed_main(handle: BroadcastHandle, rank: int, out) -> None:
    reader = ShmBroadcast.attach(handle, rank)
    n = 0
    try:
        while True:
            reader.dequeue_copy(timeout=30)
            n += 1
    except BroadcastClosed:
        out.put(("closed", n))
    except Exception as e:
        out.put((repr(e), n))
    reader.close()


def test_dead_reader_makes_blocked_enqueue_abort(procs):
    writer = ShmBroadcast.create(2, n_slots=2, slot_bytes=1 << 16)
    q = CTX.Queue()
    _start(procs, _stalling_reader_main, writer.handle(), 0, q)
    _start(procs, _reader_until_closed_main, writer.handle(), 1, q)
    victim = procs[0]
    try:
        for i in range(3):  # m2 reuses slot 0: needs both readers to have released m0
            writer.enqueue(b"m%d" % i, [bytes(1000)], timeout=30)
        assert q.get(timeout=10) == ("read one", 0)
        killer = threading.Timer(0.3, victim.kill)
        start = time.monotonic()
        killer.start()
        with pytest.raises(BroadcastAborted):  # m3 needs slot 1, which the victim never releases
            writer.enqueue(b"m3", timeout=30, should_abort=lambda: not victim.is_alive())
        elapsed = time.monotonic() - start
        killer.join()
        assert 0.25 < elapsed < 2.0, elapsed
    finally:
        writer.close()
    assert q.get(timeout=10) == ("closed", 3)  # the survivor got m0..m2, then BroadcastClosed


def _timeout_reader_main(handle: BroadcastHandle, out) -> None:
    reader = ShmBroadcast.attach(handle, 0)
    start = time.monotonic()
    try:
        reader.dequeue(timeout=0.5)
        out.put(("no timeout", 0.0))
    except TimeoutError:
        out.put(("timeout", time.monotonic() - start))
    reader.close()


def test_dequeue_times_out_when_writer_never_writes(procs):
    writer = ShmBroadcast.create(1, slot_bytes=1 << 16)
    q = CTX.Queue()
    try:
        _start(procs, _timeout_reader_main, writer.handle(), q)
        kind, elapsed = q.get(timeout=30)
        assert kind == "timeout" and 0.45 < elapsed < 2.0, (kind, elapsed)
    finally:
        writer.close()


def _wait_in_thread(reader) -> tuple[threading.Thread, list]:
    got: list = []

    def run() -> None:
        try:
            got.append(reader.dequeue_copy())  # no timeout: only a ping (or a poll an hour later) ends the wait
        except Exception as e:
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_idle_reader_sleeps_until_the_writers_ping():
    """A reader idle past busy_s blocks on the wake socket, here in chunks of an hour: only the writer's ping (a
    message, or close) can end its wait within the test's 60 s join."""
    writer = ShmBroadcast.create(1, n_slots=2, slot_bytes=4096)
    wake_file = Path(writer.handle().wake.removeprefix("ipc://"))
    assert wake_file.exists()
    reader = ShmBroadcast.attach(writer.handle(), 0, busy_s=0.0, block_s=3600.0)
    try:
        time.sleep(0.5)  # the SUB socket connects in the background (a ping sent before would be lost)
        for i in range(3):
            t, got = _wait_in_thread(reader)
            time.sleep(0.2)  # the reader is asleep on the socket by now
            writer.enqueue(b"m%d" % i, [bytes([i]) * 10])
            t.join(60)
            assert got == [(b"m%d" % i, [bytearray([i]) * 10])]
        t, got = _wait_in_thread(reader)
        time.sleep(0.2)
        writer.close()
        t.join(60)
        assert len(got) == 1 and isinstance(got[0], BroadcastClosed), got
        assert not wake_file.exists()
    finally:
        writer.close()
        reader.close()


def test_in_process_lifecycle_and_errors():
    writer = ShmBroadcast.create(2, n_slots=2, slot_bytes=4096)
    handle = writer.handle()
    assert msgspec.json.decode(msgspec.json.encode(handle), type=BroadcastHandle) == handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    with pytest.raises(ValueError):
        ShmBroadcast.attach(handle, 2)
    with pytest.raises(ValueError):
        ShmBroadcast.attach(BroadcastHandle(handle.name, 3, 2, 4096), 0)
    r0, r1 = ShmBroadcast.attach(handle, 0), ShmBroadcast.attach(handle, 1)
    with pytest.raises(BroadcastAborted):
        r0.dequeue(timeout=5, should_abort=lambda: True)
    writer.enqueue(b"small", [b"abc", b""])
    writer.enqueue(b"", [np.arange(5000, dtype=np.int64)])  # 40 KB > 4 KiB slot: spills
    with pytest.raises(TimeoutError):  # slot 0 still held by both readers
        writer.enqueue(b"blocked", timeout=0.05)
    header, views = r0.dequeue(timeout=1)
    assert (header, [bytes(v) for v in views]) == (b"small", [b"abc", b""]) and views[0].readonly
    with pytest.raises(RuntimeError):
        r0.dequeue(timeout=1)
    r0.release()
    r0.release()  # idempotent
    assert r1.dequeue_copy(timeout=1) == (b"small", [bytearray(b"abc"), bytearray()])
    spill_name = f"{handle.name}_1"
    assert spill_name in _segments()
    header, views = r0.dequeue(timeout=1)
    kept = buffer_to_tensor(views[0], "int64", (5000,))  # outlives release(): the spill stays mapped
    r0.release()
    del header, views
    assert r1.dequeue_copy(timeout=1)[1][0] == np.arange(5000, dtype=np.int64).tobytes()
    writer.enqueue(b"next")  # reclaims the fully released spill
    assert spill_name not in _segments()
    assert int(kept[-1]) == 4999
    writer.close()
    writer.close()
    writer.unlink()
    with pytest.raises(BroadcastClosed):
        writer.enqueue(b"late")
    assert r0.dequeue_copy(timeout=1) == (b"next", [])  # published before close: still delivered
    with pytest.raises(BroadcastClosed):
        r0.dequeue(timeout=1)
    with pytest.raises(FileNotFoundError):
        ShmBroadcast.attach(handle, 0)
    r0.close()
    r1.close()
    r1.close()
    del kept


def test_tensor_helpers_zero_copy():
    import torch

    for t in (torch.randn(4, 5), torch.randn(3, 7).bfloat16(), torch.tensor(1.25, dtype=torch.bfloat16)):
        buf = tensor_to_buffer(t)
        assert buf.nbytes == t.numel() * t.element_size()
        for dtype in (t.dtype, str(t.dtype), str(t.dtype).removeprefix("torch.")):
            back = buffer_to_tensor(buf, dtype, t.shape)
            assert back.dtype == t.dtype and back.shape == t.shape and back.data_ptr() == t.data_ptr()
            assert torch.equal(back.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    nc = torch.randn(6, 4).to(torch.bfloat16).t()
    assert torch.equal(buffer_to_tensor(tensor_to_buffer(nc), "bfloat16", nc.shape), nc)
    empty = buffer_to_tensor(tensor_to_buffer(torch.empty(0, 3)), "float32", (0, 3))
    assert empty.shape == (0, 3) and empty.dtype == torch.float32
    with pytest.raises((ValueError, RuntimeError)):
        buffer_to_tensor(b"\0" * 6, "float32", (2,))


_TRACKER_SCRIPT = """
import multiprocessing as mp
import sys
sys.path.insert(0, {root!r})
from eric_epd.executor.shm_broadcast import ShmBroadcast

def read(handle, rank):
    reader = ShmBroadcast.attach(handle, rank)
    for _ in range(3):
        reader.dequeue_copy(timeout=30)
    reader.close()

if __name__ == "__main__":
    writer = ShmBroadcast.create(2, n_slots=2, slot_bytes=4096)
    ps = [mp.get_context("spawn").Process(target=read, args=(writer.handle(), r)) for r in range(2)]
    for p in ps:
        p.start()
    for i in range(3):
        writer.enqueue(b"h", [bytes(100_000 * (i % 2))], timeout=30)  # messages 1 spills
    for p in ps:
        p.join(30)
    writer.close()
    print("ok", [p.exitcode for p in ps])
"""


def test_no_resource_tracker_warnings(tmp_path):
    script = tmp_path / "tracker_check.py"
    script.write_text(textwrap.dedent(_TRACKER_SCRIPT.format(root=_ROOT)))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "ok [0, 0]", res.stderr
    assert "resource_tracker" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def _throughput_reader_main(handle: BroadcastHandle, rank: int, n_warm: int, n_msgs: int, copy: bool,
                            out) -> None:
    reader = ShmBroadcast.attach(handle, rank)
    for i in range(n_warm + n_msgs):
        if copy:
            reader.dequeue_copy(timeout=30)
        else:
            with reader.receive(timeout=30) as (_, views):
                assert views[0][-1] == 7
        if i == n_warm - 1:
            out.put("warm")
    reader.close()
    out.put("done")


_FITS = (64 << 20) + 4096  # a 64 MiB buffer plus the message table fits one slot


@pytest.mark.parametrize(("slot_bytes", "copy"), [(_FITS, False), (32 << 20, False), (_FITS, True)],
                         ids=["in-slot", "spill", "copy-out"])
def test_throughput_64mib_two_readers(procs, slot_bytes, copy):
    """Logs (not asserts) throughput; run with -rP or -o log_cli=true to see it."""
    n_warm, n_msgs, size = 4, 10, 64 << 20  # warm-up fills every slot once (first-touch page faults)
    payload = np.full(size, 7, dtype=np.uint8)
    writer = ShmBroadcast.create(2, n_slots=4, slot_bytes=slot_bytes)
    q = CTX.Queue()
    try:
        for rank in range(2):
            _start(procs, _throughput_reader_main, writer.handle(), rank, n_warm, n_msgs, copy, q)
        for _ in range(n_warm):
            writer.enqueue(b"x", [payload], timeout=30, should_abort=_any_dead(procs))
        assert [q.get(timeout=30) for _ in procs] == ["warm", "warm"]
        start = time.perf_counter()
        for _ in range(n_msgs):
            writer.enqueue(b"x", [payload], timeout=30, should_abort=_any_dead(procs))
        assert [q.get(timeout=60) for _ in procs] == ["done", "done"]
        elapsed = time.perf_counter() - start
    finally:
        writer.close()
    mode = "spilled" if slot_bytes < size else "readers copy out" if copy else "in-slot, zero-copy readers"
    logger.info("shm_broadcast throughput (%s): %d x 64 MiB to 2 readers in %.3f s = %.2f GB/s, %.1f msg/s",
                mode, n_msgs, elapsed, n_msgs * size / elapsed / 1e9, n_msgs / elapsed)
