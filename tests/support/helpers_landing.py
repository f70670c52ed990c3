"""Shared by the vLLM connector's fault tests: a real producer process (module-scoped fixture) that can be stalled,
its pool entries of seeded bytes, and two ranks' landing areas reading over HTTP."""

from __future__ import annotations

import base64
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgspec
import pytest
import torch

from eric_epd.plugins.vllm.landing import LandingAddress, LandingArea
from eric_epd.plugins.vllm.staging import Prefetcher
from eric_epd.testing.server import PoolServer
from eric_epd.testing.stack import wait_for
from eric_epd.transfer.client import EmbeddingFetcher, as_handle
from eric_epd.wire.handles import EmbeddingHandle

ITEM = 256 << 10
WIDTH = 16


@pytest.fixture(scope="module")
def producer() -> Iterator[PoolServer]:
    """A transfer-only producer (shm, 16 MiB pool), one for each module that uses it."""
    with PoolServer(backends="shm", pool_bytes=16 << 20) as server:
        yield server


@contextmanager
def stalled(producer: PoolServer) -> Iterator[None]:
    """The producer stops answering (SIGSTOP) until the block ends."""
    os.kill(producer.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)


@contextmanager
def ranks(address: LandingAddress, nbytes: int, out_dtype: torch.dtype | None = None) -> Iterator[list[LandingArea]]:
    """Two workers' landing areas (CPU memory) reading over HTTP, so that a stalled producer stalls their reads."""
    areas = [
        LandingArea(
            address, r, nbytes, torch.device("cpu"), EmbeddingFetcher(("http",), http_timeout_s=300), 4, out_dtype
        )
        for r in range(2)
    ]
    try:
        yield areas
    finally:
        for area in areas:
            area.close()


def pool_entry(
    producer: PoolServer, key: str, seed: int, leases: int = 2, data: torch.Tensor | None = None
) -> list[EmbeddingHandle]:
    """A pool entry of seeded bytes (or `data`), and one handle per lease on it."""
    body: dict = {"hash": key, "nbytes": ITEM, "seed": seed, "leases": leases}
    if data is not None:
        body |= {
            "data": base64.b64encode(data.numpy().tobytes()).decode(),
            "shape": list(data.shape),
            "dtype": str(data.dtype).removeprefix("torch."),
        }
    resp = httpx.post(producer.url + "/v1/testing/entries", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    first = as_handle(resp.json())
    return [msgspec.structs.replace(first, lease=token) for token in resp.json()["leases"]]


def pool_entries(producer: PoolServer) -> int:
    """How many entries the producer's pool holds."""
    return httpx.get(producer.url + "/v1/transfer", timeout=30).json()["entries"]


def landing_idle(prefetch: Prefetcher, areas: list[LandingArea]) -> bool:
    """Every range free and every rank's copy dropped (late ranks answer, releases arrive, in their own time)."""
    return wait_for(lambda: prefetch.used_bytes() == 0 and all(a.copies() == 0 for a in areas), 60, 0.05)
