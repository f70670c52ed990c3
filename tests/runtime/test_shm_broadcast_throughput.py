"""The executor's shm broadcast throughput: 64 MiB messages to two reader processes, in a slot, spilled or copied
out (logged, not asserted); CPU only."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from eric_epd.runtime.executor.shm_broadcast import BroadcastHandle, ShmBroadcast
from tests.support import helpers_shm
from tests.support.helpers_shm import CTX
from tests.support.helpers_shm import any_dead as _any_dead
from tests.support.helpers_shm import start as _start

# every test here checks that no segment leaked; `procs` reaps the reader processes a test starts
no_leaked_segments, procs = helpers_shm.no_leaked_segments, helpers_shm.procs

logger = logging.getLogger(__name__)


def _throughput_reader_main(handle: BroadcastHandle, rank: int, n_warm: int, n_msgs: int, copy: bool, out) -> None:
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


@pytest.mark.parametrize(
    ("slot_bytes", "copy"), [(_FITS, False), (32 << 20, False), (_FITS, True)], ids=["in-slot", "spill", "copy-out"]
)
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
    logger.info(
        "shm_broadcast throughput (%s): %d x 64 MiB to 2 readers in %.3f s = %.2f GB/s, %.1f msg/s",
        mode,
        n_msgs,
        elapsed,
        n_msgs * size / elapsed / 1e9,
        n_msgs / elapsed,
    )
