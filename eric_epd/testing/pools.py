"""Pool accounting checks for tests: an in-process embedding pool's books add up exactly, and a server's pool (an
Eric, a pool server) drains back to exactly 0 held bytes and entries once nothing is held."""

from __future__ import annotations

import time
from typing import Any

import httpx

from eric_epd.transfer.pool import EmbeddingPool


def assert_books_exact(pool: EmbeddingPool) -> None:
    """The pool's accounting adds up (EmbeddingPool.audit): exactly 0 used when nothing is held."""
    problem = pool.audit()
    assert problem is None, f"pool {pool.name}: {problem}"


def assert_pool_empty(pool: EmbeddingPool) -> None:
    """Nothing held (cached entries aside), and the books say exactly that."""
    assert_books_exact(pool)
    assert (len(pool), pool.used_bytes) == (0, 0), (len(pool), pool.used_bytes)


def transfer_stats(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """GET /v1/transfer of a producer."""
    resp = httpx.get(url + "/v1/transfer", headers=headers or {}, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def held_bytes(url: str, headers: dict[str, str] | None = None) -> int:
    """Pool bytes a producer holds under leases (what its content cache keeps is evictable and not counted)."""
    stats = transfer_stats(url, headers)
    return stats["used_bytes"] - stats["cached_bytes"]


def wait_pool_drained(url: str, headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll the producer at `url` until it holds nothing (used_bytes and entries exactly 0; its content cache aside)
    and return its stats; fails naming what is still held when `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = transfer_stats(url, headers)
        if stats["used_bytes"] == 0 and stats["entries"] == 0:
            return stats
        assert time.monotonic() < deadline, f"{url} still holds {stats['entries']} entries, {stats['used_bytes']} B"
        time.sleep(0.2)
