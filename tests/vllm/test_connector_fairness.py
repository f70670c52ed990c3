"""The connector's prefetch threads are shared fairly between Erics: one that stalls (each of its fetches waiting out
its timeouts) runs at most all but one of them, so another Eric's items land meanwhile. Stand-ins for the landing
channel and the fetcher (no processes): only the scheduling of the fetches is under test."""

from __future__ import annotations

import threading

from eric_epd.plugins.vllm.staging import Prefetcher, State
from eric_epd.testing.stack import wait_for
from eric_epd.wire.handles import EmbeddingHandle

STALLED, HEALTHY = "http://stalled:8100", "http://healthy:8100"


class StandInChannel:
    """Lands at once, except from STALLED: there until `go` is set (a producer that stopped answering)."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def land(self, offset: int, handle: EmbeddingHandle, timeout_s: float, only: str = "", settled=None) -> str:
        if handle.producer == STALLED:
            self.go.wait(30)
        return "shm"

    def release(self, offset: int) -> None:
        pass

    def close(self) -> None:
        pass


class StandInFetcher:
    def confirm(self, h: EmbeddingHandle, backend: str, reread, attempt_timeout_s: float | None = None) -> str:
        return backend

    def ack(self, h: EmbeddingHandle, timeout_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def _handle(key: str, producer: str) -> EmbeddingHandle:
    digest, url = key * 64, f"{producer}/v1/embeddings/{key * 64}"
    return EmbeddingHandle(digest, (1, 8), "float32", 32, producer, "i", url, lease=key)


def test_a_stalled_eric_leaves_a_thread_to_the_others() -> None:
    channel = StandInChannel()
    prefetch = Prefetcher(channel, StandInFetcher(), 1 << 16, threads=2, land_timeout_s=30)  # type: ignore[arg-type]
    try:
        stalled = [prefetch.want(k, _handle(k, STALLED), f"r{k}") for k in "ab"]  # as many as there are threads
        healthy = prefetch.want("c", _handle("c", HEALTHY), "rc")
        assert healthy is not None and all(s is not None for s in stalled)
        assert wait_for(lambda: healthy.state is State.READY, 10, 0.01)  # not queued behind the stalled Eric
        assert all(s.state is State.PENDING for s in stalled)  # type: ignore[union-attr]
        channel.go.set()
        assert wait_for(lambda: all(s.state is State.READY for s in stalled), 10, 0.01)  # type: ignore[union-attr]
    finally:
        channel.go.set()
        prefetch.close()
