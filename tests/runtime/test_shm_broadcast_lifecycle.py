"""The executor's shm broadcast lifecycle: a dead reader aborts a blocked enqueue, a reader times out or sleeps
until the writer's ping, close/unlink and misuse errors, and no resource tracker warnings; CPU only."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from eric_epd.runtime.executor.shm_broadcast import BroadcastAborted, BroadcastClosed, BroadcastHandle, ShmBroadcast
from eric_epd.runtime.executor.tensor_views import buffer_to_tensor
from tests.support import helpers_shm
from tests.support.helpers_shm import CTX
from tests.support.helpers_shm import ROOT as _ROOT
from tests.support.helpers_shm import segments as _segments
from tests.support.helpers_shm import start as _start

# every test here checks that no segment leaked; `procs` reaps the reader processes a test starts
no_leaked_segments, procs = helpers_shm.no_leaked_segments, helpers_shm.procs


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


_TRACKER_SCRIPT = """
import multiprocessing as mp
import sys
sys.path.insert(0, {root!r})
from eric_epd.runtime.executor.shm_broadcast import ShmBroadcast

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
