"""The connector's prefetch threads and landing space are shared fairly: an Eric that stalls (each of its fetches
waiting out its timeouts) runs at most all but one of the threads, so another Eric's items land meanwhile; a request
starts its fetches all or none, so two requests never each hold part of what they need. Stand-ins for the landing
channel and the fetcher (no processes): only the scheduling of the fetches is under test."""

from __future__ import annotations

import threading

from eric_epd.plugins.vllm.landing import LandingTimeoutError
from eric_epd.plugins.vllm.staging import Prefetcher, State
from eric_epd.testing.stack import wait_for
from eric_epd.transfer.free_list import ALIGN
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
    def confirm(
        self, h: EmbeddingHandle, backend: str, reread, attempt_timeout_s: float | None = None, keep: bool = False
    ) -> tuple[str, EmbeddingHandle | None]:
        return backend, None

    def ack(self, h: EmbeddingHandle, timeout_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def _handle(key: str, producer: str = HEALTHY, units: int = 1) -> EmbeddingHandle:
    """A handle on `key` (one character) of `units` ALIGN-sized blocks."""
    digest, url = key * 64, f"{producer}/v1/embeddings/{key * 64}"
    rows = units * ALIGN // 32
    return EmbeddingHandle(digest, (rows, 8), "float32", rows * 32, producer, "i", url, lease=key)


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


def test_a_request_starts_its_fetches_all_or_none() -> None:
    """Two requests must never each hold part of what they need while what is left fits neither (both then failed
    at the room timeout): one whose items do not all fit now takes no space at all."""
    prefetch = Prefetcher(StandInChannel(), StandInFetcher(), 100 * ALIGN, threads=2, land_timeout_s=30)  # type: ignore[arg-type]
    try:
        assert prefetch.want("o", _handle("o", units=30), "other") is not None
        first = [("a", _handle("a", units=40)), ("b", _handle("b", units=50))]  # 30 + 90 > 100
        assert not prefetch.fits("r1", first)
        assert prefetch.used_bytes() == 30 * ALIGN  # it took nothing, not its first item's 40
        second = [("c", _handle("c", units=30)), ("d", _handle("d", units=40))]  # 30 + 70 = 100
        assert prefetch.fits("r2", second)
        assert all(prefetch.want(key, handle, "r2") is not None for key, handle in second)
        assert prefetch.used_bytes() == 100 * ALIGN
        assert prefetch.fits("r2", second)  # staged now: nothing more to make room for
    finally:
        prefetch.close()


class LateChannel(StandInChannel):
    """Landings from STALLED time out at once while their ranks still read: each rank answers (`settled`) only when
    `go` is set. The others land at once. Records the order its landings were asked in."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []
        self._late: list = []

    def land(self, offset: int, handle: EmbeddingHandle, timeout_s: float, only: str = "", settled=None) -> str:
        self.asked.append(handle.hash[0])
        if handle.producer == STALLED:
            self._late.append(settled)
            raise LandingTimeoutError(f"landing of {handle.hash[:16]}: 1 of 1 ranks did not answer")
        return "shm"

    def answer_late(self) -> None:
        for settled in self._late:
            settled()


def test_a_stalled_erics_next_fetch_waits_until_its_late_ranks_answer() -> None:
    """A landing that timed out leaves its ranks reading: the stalled Eric's slot stays taken until they answer, so
    its queued fetch does not start meanwhile (the workers' threads would fill with its reads); another Eric's item
    lands at once; once the ranks answer, the queued fetch starts."""
    channel = LateChannel()
    prefetch = Prefetcher(channel, StandInFetcher(), 1 << 16, threads=2, land_timeout_s=30)  # type: ignore[arg-type]
    try:
        first = prefetch.want("a", _handle("a", STALLED), "ra")  # one thread per Eric at most: a runs, b queues
        queued = prefetch.want("b", _handle("b", STALLED), "rb")
        assert first is not None and queued is not None
        assert wait_for(lambda: first.state is State.FAILED, 10, 0.01)  # timed out, its rank still reading
        healthy = prefetch.want("c", _handle("c", HEALTHY), "rc")
        assert healthy is not None and wait_for(lambda: healthy.state is State.READY, 10, 0.01)
        assert queued.state is State.PENDING and channel.asked == ["a", "c"]  # b waits for a's late rank
        channel.answer_late()
        assert wait_for(lambda: queued.state is State.FAILED, 10, 0.01)  # it ran (and timed out in its turn)
        assert channel.asked == ["a", "c", "b"]
    finally:
        channel.answer_late()
        prefetch.close()
