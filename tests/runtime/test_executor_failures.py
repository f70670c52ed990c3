"""The executor's broadcast failing while its workers live (a spill segment that cannot be created, a timeout): the
workers are stopped before WorkersDeadError reaches the engine, which then answers every request, so no worker can
still write into a region the router frees on that answer. Real processes stand in for the workers."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

import numpy as np
import pytest

from eric_epd.runtime.executor.executor import ModelExecutor
from eric_epd.runtime.work import Batch, WorkersDeadError
from tests.support.helpers_engine import work_request


class _BrokenBroadcast:
    """ShmBroadcast stand-in whose enqueue fails as creating a spill segment in a full /dev/shm does."""

    def enqueue(self, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")


def _executor_with_live_workers(n: int) -> ModelExecutor:
    """A ModelExecutor whose workers are `n` live processes (sleeping: busy with an earlier batch) and whose
    broadcast fails; built without __init__, which would load a model."""
    executor = ModelExecutor.__new__(ModelExecutor)
    executor._config = SimpleNamespace(worker_timeout_s=5.0)
    executor._broadcast = _BrokenBroadcast()
    executor._dead_reason = None
    executor._beat = lambda: None  # no engine heartbeat to renew
    executor._submitted = set()
    executor._procs = [mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True) for _ in range(n)]
    for p in executor._procs:
        p.start()
    return executor


def test_a_failed_broadcast_stops_live_workers_before_the_engine_hears_of_it() -> None:
    executor = _executor_with_live_workers(2)
    try:
        msg, buffers = work_request("r", ["a"])
        batch = Batch(7, "image", [SimpleNamespace(item=msg.items[0], input=np.asarray(buffers[0]))])
        with pytest.raises(WorkersDeadError, match="No space left on device"):
            executor.submit(batch)
        assert not any(p.is_alive() for p in executor._procs)  # none can write any more
        assert "broadcast to workers failed" in executor.check_workers()  # sticky: the engine reports unhealthy
        assert 7 not in executor._submitted
    finally:
        for p in executor._procs:
            p.kill()
            p.join()
