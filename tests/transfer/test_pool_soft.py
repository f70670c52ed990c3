"""Soft leases (an ack with keep answers one): they hold their entry like any lease, but yield it when a reservation
needs the room; never one a hard lease or a fence holds, and never when the room would still not be enough."""

from __future__ import annotations

import time

import pytest

from eric_epd.transfer.free_list import ALIGN
from eric_epd.transfer.pool import EmbeddingPool, LeaseError


def _pool(nbytes: int) -> EmbeddingPool:
    return EmbeddingPool(f"eric-test-{time.monotonic_ns()}", nbytes, ttl_s=60)


def _held(pool: EmbeddingPool, key: str, nbytes: int) -> None:
    """A written entry, not yet leased."""
    assert pool.reserve(key, nbytes, (nbytes,), "uint8") is not None
    pool.commit(key)


def test_entries_only_soft_leases_hold_yield_to_a_reservation_that_needs_room() -> None:
    """A soft child lease (an ack with keep) holds its entry like any lease, but when a reservation finds no room the
    pool evicts entries held by such leases alone (the oldest first), never one a hard lease or a fence holds; the
    soft lease is then gone (its consumer's next proof fails)."""
    pool = _pool(4 * ALIGN)
    try:
        for key in "abcd":
            _held(pool, key, ALIGN)
        _, a = pool.lease("a")
        (a_soft,) = pool.add_leases("a", a, 1, soft=True)
        assert pool.ack("a", a)  # "a": its soft lease alone
        _, b = pool.lease("b")
        pool.add_leases("b", b, 1, soft=True)  # "b": a hard lease and a soft one
        _, c = pool.lease("c")
        (c_soft,) = pool.add_leases("c", c, 1, soft=True)
        assert pool.ack("c", c)
        fence = pool.hold(pool.get("c"), "engine")  # "c": soft alone, but fenced
        _, d = pool.lease("d")
        (d_soft,) = pool.add_leases("d", d, 1, soft=True)
        assert pool.ack("d", d)  # "d": soft alone, taken after "a" (a later TTL)
        assert [k for k in "abcd" if pool.get(k).yields()] == ["a", "d"]  # type: ignore[union-attr]

        assert pool.reserve("e", ALIGN, (ALIGN,), "uint8") is not None  # room: "a" evicted, the oldest
        assert pool.get("a") is None
        with pytest.raises(LeaseError):
            pool.holder("a", a_soft)
        assert pool.evictions == 1 and pool.get("d").holds(d_soft)  # type: ignore[union-attr]
        assert pool.reserve("f", ALIGN, (ALIGN,), "uint8") is not None  # then "d"
        assert pool.get("d") is None and pool.evictions == 2
        assert pool.reserve("g", ALIGN, (ALIGN,), "uint8") is None  # "b" (hard) and "c" (fenced) stay
        assert pool.get("b") is not None and pool.get("c").holds(c_soft)  # type: ignore[union-attr]
        fence.end()
        assert pool.audit() is None
    finally:
        pool.close()


def test_nothing_is_evicted_when_even_every_yielding_entry_would_not_make_room() -> None:
    """A reservation larger than the free space and every soft-only entry together evicts none of them."""
    pool = _pool(4 * ALIGN)
    try:
        for key in "ab":
            _held(pool, key, ALIGN)
            _, token = pool.lease(key)
            pool.add_leases(key, token, 1, soft=True)
            assert pool.ack(key, token)  # soft-only
        _held(pool, "c", 2 * ALIGN)
        pool.lease("c")  # hard
        assert pool.reserve("big", 3 * ALIGN, (3 * ALIGN,), "uint8") is None  # 2 yielding blocks < 3
        assert pool.get("a") is not None and pool.get("b") is not None and pool.evictions == 0
        assert pool.reserve("two", 2 * ALIGN, (2 * ALIGN,), "uint8") is not None  # 2 blocks: both go
        assert pool.get("a") is None and pool.get("b") is None and pool.evictions == 2
        assert pool.audit() is None
    finally:
        pool.close()
