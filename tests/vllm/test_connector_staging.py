"""The vLLM connector's prefetch: workers' landing areas filled on the scheduler's order (real ZMQ sockets, two
ranks) from a real producer process (Eric's pool and control API, no model): bytes exact on every rank over shm and
NIXL (read straight into the registered area), leases acknowledged only once every rank has the bytes, space reused
only when no request or step holds it, a rank that never answers keeps its range out of use."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch

from eric_epd.plugins.vllm.landing import LandingAddress, LandingArea, LandingChannel, LandingTimeoutError
from eric_epd.plugins.vllm.settings import EricConnectorSettings
from eric_epd.plugins.vllm.staging import Prefetcher, State
from eric_epd.testing.pool_server import seeded_bytes
from eric_epd.testing.server import PoolServer
from eric_epd.testing.stack import wait_for
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher, as_handle


@pytest.fixture(scope="module")
def producer():
    with PoolServer(backends="shm,nixl", pool_bytes=64 << 20) as server:
        yield server


@contextmanager
def landing(
    nbytes: int,
    ranks: int = 2,
    backends: tuple[str, ...] = ("shm", "http"),
    threads: int = 2,
    land_timeout_s: float = 30.0,
    answering: int | None = None,
) -> Iterator[tuple[Prefetcher, list]]:
    """A scheduler's prefetcher and `ranks` workers' landing areas (CPU memory), as the connector wires them; only
    the first `answering` ranks exist (the others never answer)."""
    address = LandingAddress(f"test{uuid.uuid4().hex[:8]}")
    areas = [
        LandingArea(address, r, nbytes, torch.device("cpu"), EmbeddingFetcher(backends), threads)
        for r in range(ranks if answering is None else answering)
    ]
    prefetch = Prefetcher(LandingChannel(address, ranks), EmbeddingFetcher(backends), nbytes, threads, land_timeout_s)
    try:
        yield prefetch, areas
    finally:
        prefetch.close()
        for area in areas:
            area.close()


def _entry(producer, key: str, nbytes: int, seed: int):
    resp = httpx.post(
        producer.url + "/v1/testing/entries", json={"hash": key, "nbytes": nbytes, "seed": seed}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    return as_handle(resp.json())


def _settled(prefetch: Prefetcher, key: str) -> State:
    deadline = time.monotonic() + 30
    while (item := prefetch.get(key)) is not None and item.state is State.PENDING and time.monotonic() < deadline:
        prefetch.wait(0.05)
    return prefetch.get(key).state  # type: ignore[union-attr]


def _entries(producer) -> int:
    return httpx.get(producer.url + "/v1/transfer", timeout=30).json()["entries"]


@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_prefetch_lands_on_every_rank_and_frees(producer, backend: str) -> None:
    assert _entries(producer) == 0
    with landing(4 << 20, backends=(backend,)) as (prefetch, areas):
        handles = [_entry(producer, f"stage{i}", 100_000 + 4 * i, seed=i) for i in range(3)]
        for i, h in enumerate(handles):
            assert prefetch.want(h.hash, h, f"r{i}") is not None
        assert all(_settled(prefetch, h.hash) is State.READY for h in handles)
        kept = [prefetch.get(h.hash).kept for h in handles]  # type: ignore[union-attr]
        # every lease acknowledged once its bytes were staged, a child lease answered in its place
        assert all(k is not None and k.lease != h.lease for k, h in zip(kept, handles, strict=True))
        assert _entries(producer) == 3  # held by the children alone
        second = prefetch.want(handles[0].hash, handles[0], "r9")  # another request for the same item: no new fetch
        assert second is prefetch.get(handles[0].hash)
        used = prefetch.used_bytes()
        for i, h in enumerate(handles):
            load, via = prefetch.to_workers(h.hash, f"r{i}")
            assert via == backend
            for area in areas:  # every rank holds the bytes, and copies them out as a new tensor
                tensor = area.tensor(load.offset, (h.nbytes,), "uint8", torch.uint8)
                assert np.array_equal(tensor.numpy(), seeded_bytes(h.nbytes, i))
                assert tensor.data_ptr() != area.buffer.data_ptr() + load.offset
        prefetch.copied([h.hash for h in handles])
        assert prefetch.get(handles[1].hash) is None and prefetch.get(handles[2].hash) is None
        assert prefetch.used_bytes() < used  # r9 still waits for item 0; the others are free
        prefetch.drop(handles[0].hash, "r9")
        assert prefetch.used_bytes() == 0 and not prefetch.busy()
        assert wait_for(lambda: _entries(producer) == 0, 30)  # the children nobody took went back with their items


def test_prefetch_failures_and_room(producer) -> None:
    with landing(1 << 20, threads=1) as (prefetch, _):
        big = _entry(producer, "big", (1 << 20) + 1, seed=5)
        with pytest.raises(TransferError, match="staging_bytes"):
            prefetch.want(big.hash, big, "r")
        half = _entry(producer, "half", 600_000, seed=6)
        other = _entry(producer, "other", 600_000, seed=7)
        assert prefetch.want(half.hash, half, "a") is not None
        assert prefetch.want(other.hash, other, "b") is None  # no room now: the request waits for a later step
        assert _settled(prefetch, half.hash) is State.READY
        prefetch.drop(half.hash, "a")  # its request ended: the space comes back
        assert prefetch.want(other.hash, other, "b") is not None and _settled(prefetch, other.hash) is State.READY
        forged = msgspec.structs.replace(_entry(producer, "forged", 4096, seed=8), lease="0" * 32)
        assert prefetch.want(forged.hash, forged, "c") is not None
        assert _settled(prefetch, forged.hash) is State.FAILED  # a stranger's token: read or ack refused
        assert "forged" in prefetch.get(forged.hash).error  # type: ignore[union-attr]
        prefetch.drop(forged.hash, "c")
        prefetch.drop(other.hash, "b")
        assert prefetch.used_bytes() == 0


def test_a_rank_that_never_answers_fails_the_item_and_keeps_its_range(producer) -> None:
    before = _entries(producer)
    with landing(1 << 20, ranks=2, answering=1, land_timeout_s=1.0) as (prefetch, _):
        h = _entry(producer, "silent-rank", 8192, seed=9)
        prefetch.want(h.hash, h, "r")
        assert _settled(prefetch, h.hash) is State.FAILED
        assert "1 of 2 ranks did not answer" in prefetch.get(h.hash).error  # type: ignore[union-attr]
        prefetch.drop(h.hash, "r")
        assert prefetch.used_bytes() > 0  # the silent rank may still write there: never reused
    assert _entries(producer) == before + 1  # never acknowledged: Eric keeps it to its TTL
    assert issubclass(LandingTimeoutError, TransferError)


def test_connector_settings() -> None:
    s = EricConnectorSettings.parse({"eric_urls": "http://a:1,http://b:2/"}, environ={"ERIC_API_KEY": "k"})
    assert s.eric_urls == ("http://a:1", "http://b:2") and s.api_key == "k" and s.mooncake.protocol == "tcp"
    s = EricConnectorSettings.parse(
        {
            "eric_urls": ["http://a:1"],
            "mooncake_protocol": "rdma",
            "mooncake_device": "mlx5_0",
            "mooncake_host": "10.0.0.7",
            "staging_bytes": 1 << 24,
        },
        environ={},
    )
    assert (s.mooncake.protocol, s.mooncake.device, s.mooncake.host, s.staging_bytes, s.api_key) == (
        "rdma",
        "mlx5_0",
        "10.0.0.7",
        1 << 24,
        None,
    )
    for bad in (
        {},
        {"eric_urls": ["http://a:1"], "backends": ["carrier-pigeon"]},
        {"eric_urls": ["http://a:1"], "mooncake_protocol": "udp"},
        {"eric_urls": ["http://a:1"], "staging_bytes": 10},
    ):
        with pytest.raises(ValueError):
            EricConnectorSettings.parse(bad, environ={})


def test_the_connector_refuses_layouts_it_cannot_land_on() -> None:
    from types import SimpleNamespace

    from eric_epd.plugins.vllm.connector import check_topology

    check_topology(SimpleNamespace(pipeline_parallel_size=1, nnodes=1))  # tensor parallel on one node: served
    with pytest.raises(ValueError, match="pipeline parallelism"):  # its stages' ranks would share one socket name
        check_topology(SimpleNamespace(pipeline_parallel_size=2, nnodes=1))
    with pytest.raises(ValueError, match="spans 2 nodes"):  # the landing area is one host's shared memory
        check_topology(SimpleNamespace(pipeline_parallel_size=1, nnodes=2))
    with pytest.raises(ValueError, match="prefill context parallelism"):  # two workers per tensor-parallel rank
        check_topology(SimpleNamespace(pipeline_parallel_size=1, nnodes=1, prefill_context_parallel_size=2))


def test_data_parallel_engines_land_on_sockets_of_their_own() -> None:
    """vLLM runs each engine of a dense model's data parallelism as an independent rank: data_parallel_rank is 0 in
    every one (and the instance id the same), so the landing sockets are named by data_parallel_index, which differs;
    named by the rank, both engines' schedulers and workers would share one set of sockets."""
    from vllm.config import ParallelConfig

    from eric_epd.plugins.vllm.connector import dp_index

    engines = []
    for rank in range(2):
        config = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank, data_parallel_size_local=2)
        config.reconfigure_for_independent_dp_rank()  # as vLLM's run_engine_core does
        engines.append(config)
    assert [e.data_parallel_rank for e in engines] == [0, 0]  # the control: the rank would collide
    addresses = [LandingAddress("same-instance", dp_index(e)) for e in engines]
    assert addresses[0].orders(0) != addresses[1].orders(0) and addresses[0].notices() != addresses[1].notices()


def test_unanswered_ack_is_sent_again(producer) -> None:
    """The producer stops answering (SIGSTOP) right after the bytes were read: the ack is sent again on a new
    connection, marked as a retry; once the producer resumes, whichever attempt it reads first ends the lease and
    the retry is answered 200 (the retry of an ack that took effect: "already acknowledged"), never a 404."""
    fetcher = EmbeddingFetcher(["shm", "http"], http_timeout_s=30)
    before = _entries(producer)
    h = _entry(producer, "late-ack", 4096, seed=3)
    dst = np.empty(h.nbytes, np.uint8)
    fetcher.read_into(h, dst)
    os.kill(producer.proc.pid, signal.SIGSTOP)
    resume = threading.Timer(2.5, os.kill, (producer.proc.pid, signal.SIGCONT))
    resume.start()
    try:
        started = time.monotonic()
        fetcher.ack(h, attempt_timeout_s=1.0)
        assert time.monotonic() - started >= 2.0  # it really waited for the stopped producer
    finally:
        resume.join()
        os.kill(producer.proc.pid, signal.SIGCONT)
        fetcher.close()
    assert np.array_equal(dst, seeded_bytes(h.nbytes, 3)) and _entries(producer) == before


def test_landing_sockets_live_in_a_directory_only_their_user_may_enter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sockets' directory is made 0700; one others may enter (another user could bind the names first, or send
    the workers orders) is refused, as is a file in its place; a path too long for a Unix socket is a clear error."""
    from eric_epd.plugins.vllm.landing import private_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = Path(private_dir())
    assert made.parent == tmp_path and made.stat().st_mode & 0o777 == 0o700
    assert LandingAddress("x").notices() == f"ipc://{made}/x-0-notices.ipc"
    with pytest.raises(RuntimeError, match="shorter TMPDIR"):  # past what a Unix socket's path holds
        LandingAddress("x" * 120).notices()
    made.chmod(0o777)
    with pytest.raises(RuntimeError, match="0700"):
        private_dir()
    made.rmdir()
    made.write_text("")
    with pytest.raises(RuntimeError, match="0700"):
        private_dir()


def test_a_landing_counts_as_from_the_store_only_if_every_rank_read_the_store() -> None:
    """Bytes from Eric's pool stand only once the ack proves the lease held; bytes from the global store are
    content-addressed. A landing where rank 0 read the store but another rank read the producer is not a store
    landing: its ack must hold (else every rank reads the store again)."""
    from eric_epd.plugins.vllm.landing import _landed_over

    assert _landed_over({0: "store", 1: "store"}) == "store"
    assert _landed_over({0: "store", 1: "shm"}) == "shm"
    assert _landed_over({0: "nixl", 1: "store"}) == "nixl"
    assert _landed_over({0: "http"}) == "http"
