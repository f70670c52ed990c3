"""The embedding pool without servers: its allocator, leases as capability tokens (strangers change nothing, an ack
ends exactly its lease, child leases bounded, old generations powerless), expiry and the acknowledged-entry cache."""

from __future__ import annotations

import random
import time

import pytest

from eric_epd.testing.pools import assert_pool_empty
from eric_epd.transfer.config import TransferConfig
from eric_epd.transfer.free_list import ALIGN, FreeList, span
from eric_epd.transfer.pool import MAX_CHILD_LEASES, EmbeddingPool, LeaseError, new_token
from eric_epd.transfer.producer import TransferHub


def test_free_list_coalesces() -> None:
    fl = FreeList(10 * ALIGN)
    a, b, c = fl.allocate(ALIGN), fl.allocate(3 * ALIGN - 5), fl.allocate(ALIGN)
    assert (a, b, c) == (0, ALIGN, 4 * ALIGN)
    assert fl.allocate(6 * ALIGN) is None
    fl.free(b, 3 * ALIGN - 5)
    fl.free(a, ALIGN)
    fl.free(c, ALIGN)
    assert fl.free_bytes == 10 * ALIGN and fl.allocate(10 * ALIGN) == 0


def _pool(nbytes: int = 1 << 20, ttl_s: float = 60, keep_acked_bytes: int = 0) -> EmbeddingPool:
    return EmbeddingPool(f"eric-test-{time.monotonic_ns()}", nbytes, ttl_s=ttl_s, keep_acked_bytes=keep_acked_bytes)


def _hub(ttl_s: float = 300.0) -> TransferHub:
    """A producer hub over a 1 MiB pool with no backend but HTTP."""
    instance = new_token()[:16]
    return TransferHub(
        TransferConfig(pool_bytes=1 << 20, ttl_s=ttl_s, backends=()),
        pool_name=f"eric-pool-{instance}",
        instance_id=instance,
        public_url="http://127.0.0.1:8100",
    )


def _held(pool: EmbeddingPool, key: str, nbytes: int = 1000) -> None:
    """A written entry, not yet leased."""
    assert pool.reserve(key, nbytes, (nbytes,), "uint8") is not None
    pool.commit(key)


def test_pool_lease_ack_expire() -> None:
    pool = _pool(ttl_s=0.2)
    try:
        e = pool.reserve("h", 1000, (10, 25), "float32")
        assert e is not None and pool.used_bytes >= 1000
        assert pool.reserve("big", 2 << 20, (1,), "float32") is None
        pool.commit("h")
        _, t1 = pool.lease("h")
        _, t2 = pool.lease("h")
        assert t1 != t2
        assert pool.ack("h", t1) and pool.get("h") is not None  # one lease left
        assert pool.ack("h", t2) and pool.get("h") is None and pool.used_bytes == 0
        assert not pool.ack("h", t2)
        pool.reserve("t", 10, (10,), "float32")
        pool.commit("t")
        pool.lease("t")
        assert pool.expire(time.monotonic() + 1) == ["t"] and pool.used_bytes == 0
    finally:
        pool.close()


def test_a_lease_nobody_acks_lapses_though_others_keep_leasing_the_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each lease has its own TTL: on an entry leased anew within every TTL, a lease whose consumer never acked still
    lapses (its ack is then a 404), the live ones hold, and the entry goes with the last of them."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    pool = _pool(ttl_s=100)
    try:
        _held(pool, "h")
        _, abandoned = pool.lease("h")  # lapses at 1100
        clock[0] = 1060
        _, a = pool.lease("h")
        assert pool.expire() == [] and pool.get("h") is not None
        clock[0] = 1120
        _, b = pool.lease("h")
        assert pool.expire() == []  # the entry stays for a and b ...
        assert not pool.ack("h", abandoned)  # ... but the abandoned lease lapsed
        assert pool.holder("h", a) and pool.ack("h", a) and pool.ack("h", b)
        assert_pool_empty(pool)
    finally:
        pool.close()


def test_an_entry_whose_last_lease_lapsed_is_retired_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The newer lease acked, the older one abandoned: when the abandoned one lapses the entry leaves the held bytes
    at once, into the content cache (a repeat is served from it), not at the acked lease's later TTL."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    pool = _pool(ttl_s=100, keep_acked_bytes=span(1000))
    try:
        _held(pool, "h")
        pool.lease("h")  # abandoned: lapses at 1100
        clock[0] = 1060
        _, newer = pool.lease("h")  # lapses at 1160
        assert pool.ack("h", newer) and pool.used_bytes > 0  # the first lease still holds it
        clock[0] = 1101
        assert pool.expire() == ["h"]
        assert pool.used_bytes == 0 and pool.cached_bytes == span(1000)
        assert pool.get("h") is not None  # cached: leased again without encoding
        _, again = pool.lease("h")
        assert pool.ack("h", again)
    finally:
        pool.close()


def test_pool_keeps_acked_entries_as_cache() -> None:
    pool = _pool(4 * ALIGN, keep_acked_bytes=2 * ALIGN)
    try:
        tokens = {}
        for key in ("a", "b"):
            pool.reserve(key, ALIGN, (ALIGN,), "uint8")
            pool.commit(key)
            _, tokens[key] = pool.lease(key)
            assert pool.ack(key, tokens[key])
        assert len(pool) == 0 and pool.used_bytes == 0 and pool.cached_bytes == 2 * ALIGN
        assert pool.get("a") is not None and not pool.ack("a", tokens["a"])  # cached, not leased
        _, again = pool.lease("a")  # a repeat: served from the cache, no encode
        assert len(pool) == 1 and pool.cached_bytes == ALIGN
        assert again != tokens["a"] and not pool.ack("a", tokens["a"])  # the old lease stays ended
        assert pool.reserve("big", 3 * ALIGN, (1,), "uint8") is not None  # evicts "b" to make room
        assert pool.get("b") is None and pool.get("a") is not None
    finally:
        pool.close()


def _snapshot(pool: EmbeddingPool, key: str) -> tuple:
    entry = pool.get(key)
    assert entry is not None
    return dict(entry.leases), dict(entry.children), entry.expires_at, pool.used_bytes, len(pool)


def test_pool_stranger_token_changes_nothing() -> None:
    """A token that holds no lease on the entry (made up, missing, or another entry's) cannot read, add leases or
    acknowledge: every attempt is the same 404 and the entry is exactly as it was."""
    pool = _pool()
    try:
        _held(pool, "h")
        _held(pool, "other")
        _, owner = pool.lease("h")
        _, elsewhere = pool.lease("other")  # a real lease, but on another entry
        before = _snapshot(pool, "h")
        for stranger in (new_token(), None, "", elsewhere):
            assert not pool.ack("h", stranger)
            with pytest.raises(LeaseError) as err:
                pool.holder("h", stranger)
            assert err.value.status == 404
            for count in (1, MAX_CHILD_LEASES, 1024):
                with pytest.raises(LeaseError) as err:
                    pool.add_leases("h", stranger, count)
                assert err.value.status == 404
            assert _snapshot(pool, "h") == before
        with pytest.raises(LeaseError) as err:  # an unknown hash looks the same as a wrong token
            pool.holder("never-encoded", owner)
        assert err.value.status == 404
        assert pool.holder("h", owner) is pool.get("h")  # the owner still reads and acknowledges
        assert pool.ack("h", owner) and pool.get("h") is None
        assert pool.ack("other", elsewhere) and pool.used_bytes == 0
    finally:
        pool.close()


def test_pool_ack_frees_exactly_its_lease() -> None:
    pool = _pool()
    try:
        _held(pool, "h")
        tokens = [pool.lease("h")[1] for _ in range(3)]
        entry = pool.get("h")
        assert entry is not None and len(entry.leases) == 3
        assert pool.ack("h", tokens[0]) and set(entry.leases) == set(tokens[1:])
        assert not pool.ack("h", tokens[0])  # repeating it changes nothing
        assert set(entry.leases) == set(tokens[1:]) and pool.get("h") is entry
        with pytest.raises(LeaseError):
            pool.holder("h", tokens[0])  # an ended lease no longer reads
        assert pool.holder("h", tokens[1]) is entry
        assert pool.ack("h", tokens[2]) and pool.ack("h", tokens[1])
        assert pool.get("h") is None and pool.used_bytes == 0
    finally:
        pool.close()


def test_pool_two_requests_leases_are_independent() -> None:
    """Two requests leased the same content: one acknowledging twice (or more) cannot free the other's lease."""
    pool = _pool()
    try:
        _held(pool, "h")
        _, a = pool.lease("h")
        _, b = pool.lease("h")
        a_children = pool.add_leases("h", a, 2)
        assert pool.ack("h", a)
        for _ in range(3):
            assert not pool.ack("h", a)
        for child in a_children:
            assert pool.ack("h", child) and not pool.ack("h", child)
        entry = pool.get("h")
        assert entry is not None and list(entry.leases) == [b]  # all of a's gone, b's untouched
        assert pool.holder("h", b) is entry and pool.add_leases("h", b, 1)  # b still reads and extends
        assert pool.used_bytes >= 1000
    finally:
        pool.close()


def test_pool_child_leases_are_bounded() -> None:
    """A lease and the children added from it may add MAX_CHILD_LEASES in all; beyond that a 400 that adds
    nothing. Each root lease has its own budget; each child is acknowledged on its own."""
    pool = _pool()
    try:
        _held(pool, "h")
        entry, root = pool.lease("h")
        for count in (0, -1, MAX_CHILD_LEASES + 1, 1024):
            with pytest.raises(LeaseError) as err:
                pool.add_leases("h", root, count)
            assert err.value.status == 400
        assert len(entry.leases) == 1
        first = pool.add_leases("h", root, 10)
        assert len(first) == len(set(first)) == 10 and len(entry.leases) == 11
        rest = pool.add_leases("h", first[0], MAX_CHILD_LEASES - 10)  # a child spends its root's budget
        assert len(entry.leases) == 1 + MAX_CHILD_LEASES
        for token in (root, first[0], rest[-1]):
            with pytest.raises(LeaseError) as err:
                pool.add_leases("h", token, 1)
            assert err.value.status == 400
        assert len(entry.leases) == 1 + MAX_CHILD_LEASES
        assert pool.ack("h", first[0])  # acknowledging a child gives no budget back
        with pytest.raises(LeaseError):
            pool.add_leases("h", root, 1)
        _, other = pool.lease("h")  # another request's lease has a budget of its own
        assert len(pool.add_leases("h", other, MAX_CHILD_LEASES)) == MAX_CHILD_LEASES
        for token in list(entry.leases):
            assert pool.ack("h", token)
        assert pool.get("h") is None and pool.used_bytes == 0
    finally:
        pool.close()


@pytest.mark.parametrize("freed_by", ["ack", "expiry"])
def test_pool_old_generation_token_cannot_touch_new_entry(freed_by: str) -> None:
    """An entry freed (acknowledged, or expired with its lease still out) and reserved again under the same hash is
    a new generation: the old token can neither read, extend nor acknowledge it."""
    pool = _pool()
    try:
        _held(pool, "h")
        old_entry, old = pool.lease("h")
        if freed_by == "ack":
            spare = pool.add_leases("h", old, 1)[0]
            assert pool.ack("h", spare)
            assert pool.ack("h", old)
        else:
            assert pool.expire(time.monotonic() + 3600) == ["h"]
        assert pool.get("h") is None
        _held(pool, "h")
        entry, new = pool.lease("h")
        assert entry is not old_entry and entry.generation > old_entry.generation
        before = _snapshot(pool, "h")
        assert not pool.ack("h", old)
        with pytest.raises(LeaseError):
            pool.holder("h", old)
        with pytest.raises(LeaseError):
            pool.add_leases("h", old, 1)
        assert _snapshot(pool, "h") == before
        assert pool.ack("h", new) and pool.get("h") is None
    finally:
        pool.close()


def test_release_of_an_old_generation_leaves_the_newer_one() -> None:
    """A caller still holding an entry that expired and was encoded again (a new generation of the same hash) frees
    nothing when it releases its own: the newer entry stays whole for its readers."""
    hub = _hub(ttl_s=0.05)
    pool = hub.pool
    try:
        old = pool.reserve("h", 1000, (1000,), "uint8")
        assert old is not None
        pool.commit("h")
        time.sleep(0.1)
        assert pool.expire() == ["h"]
        new = pool.reserve("h", 1000, (1000,), "uint8")
        assert new is not None and new.generation != old.generation
        pool.commit("h")
        _, token = pool.lease("h")
        pool.view(new)[:] = 7
        hub.release(old)  # e.g. a failed request's late clean-up
        pool.release("h", old.generation)
        assert pool.get("h") is new and pool.holder("h", token) is new
        assert (pool.view(new) == 7).all() and pool.used_bytes >= 1000
        hub.release(new)
        assert pool.get("h") is None and pool.used_bytes == 0
    finally:
        hub.close()


def test_used_bytes_returns_exactly_to_zero_after_mixed_sizes() -> None:
    """Entries of sizes that are not multiples of ALIGN (the pool rounds them), each ending another way: acknowledged
    into the content cache (or evicted from it), acknowledged by two leases, released unwritten, detached and
    released, expired. Whenever nothing is held, used_bytes is exactly 0, cached entries or not; at the end the
    free list is whole again."""
    rng = random.Random(7)
    pool = _pool(64 * ALIGN, keep_acked_bytes=6 * ALIGN)
    fates = ("ack", "two leases", "release", "held", "expire")
    try:
        for r in range(30):
            held = {}
            for i in range(6):
                nbytes = rng.randint(1, 3 * ALIGN)
                entry = pool.reserve(f"{r}-{i}", nbytes, (nbytes,), "uint8")
                assert entry is not None
                held[entry.hash] = (entry, rng.choice(fates))
            assert pool.used_bytes == sum(span(e.nbytes) for e, _ in held.values())
            for key, (entry, fate) in held.items():
                if fate == "release":
                    pool.release(key, entry.generation)
                    continue
                if fate == "held":
                    with pool.hold(entry, "store-read"):
                        pool.release(key, entry.generation)
                        assert pool.get(key) is None and pool.used_bytes >= span(entry.nbytes)
                    continue
                pool.commit(key)
                tokens = [pool.lease(key)[1] for _ in range(2 if fate == "two leases" else 1)]
                if fate != "expire":
                    assert all(pool.ack(key, t) for t in tokens)
            pool.expire(time.monotonic() + 61)
            assert (len(pool), pool.used_bytes) == (0, 0), (r, pool.cached_bytes)
            assert pool.audit() is None and 0 <= pool.cached_bytes <= 6 * ALIGN
        assert pool.cached_bytes > 0  # the drift came from cached entries: some are there
        assert pool.reserve("all", 64 * ALIGN, (1,), "uint8") is not None  # evicts every cached entry
        pool.release("all")
        assert pool.cached_bytes == 0 and pool.audit() is None and pool.used_bytes == 0
        assert_pool_empty(pool)
    finally:
        pool.close()


def test_a_fenced_region_leaves_its_hash_at_once_and_returns_when_the_last_hold_ends() -> None:
    """A region some party may still write or read (a store read that outlived its request, an engine batch, a
    send) leaves its hash when freed: the hash is reserved again at once elsewhere, the old region stays held until
    every hold on it ends, and a later release by the old generation leaves the new reservation alone."""
    pool = _pool(8 * ALIGN)
    freed: list[int] = []
    pool._on_free = lambda: freed.append(pool.used_bytes)
    try:
        old = pool.reserve("h", 1000, (1000,), "uint8")
        assert old is not None
        reading, writing = pool.hold(old, "store-read"), pool.hold(old, "engine")
        pool.release("h", old.generation)
        assert pool.get("h") is None and old.fence == {"store-read": 1, "engine": 1}
        new = pool.reserve("h", 1000, (1000,), "uint8")
        assert new is not None and new.offset != old.offset and len(pool) == 2
        assert pool.used_bytes == 2 * span(1000)
        pool.release("h", old.generation)  # names the old generation: the new one stays
        assert pool.get("h") is new
        reading.end()
        reading.end()  # idempotent
        assert pool.used_bytes == 2 * span(1000) and freed == []
        writing.end()
        assert pool.get("h") is new and pool.used_bytes == span(1000) and freed == [span(1000)]
        pool.commit("h")
        _, token = pool.lease("h")
        with pool.hold(new, "sglang-send"):
            assert pool.ack("h", token) and pool.get("h") is None  # the last ack frees it ...
            assert pool.reserve("x", 8 * ALIGN, (1,), "uint8") is None  # ... but not its region, under the send
            assert pool.used_bytes == span(1000) and pool.audit() is None
        assert_pool_empty(pool)
    finally:
        pool.close()


def test_an_ack_retried_is_told_it_took_effect_and_an_expired_lease_is_not() -> None:
    """The producer answers a retried ack (the first answer was lost) whose first attempt took effect with 200
    'already acknowledged', changing nothing; a lease that expired (or a stranger's token) stays a 404, and so does
    a plain repeat (bytes read after the ack are proven by nothing): a consumer tells its own ack from expiry."""
    hub = _hub()
    pool = hub.pool
    try:
        for key in ("a", "b"):
            pool.reserve(key, 1000, (1000,), "uint8")
            pool.commit(key)
        _, mine = pool.lease("a")
        _, other = pool.lease("a")
        _, lapsed = pool.lease("b")
        assert hub.ack("a", mine) == (200, "ok")
        assert hub.ack("a", mine)[0] == 404  # a plain repeat
        assert hub.ack("a", mine, retry=True) == (200, "already acknowledged") and pool.holder("a", other)
        assert hub.ack("b", mine, retry=True)[0] == 404  # the token names a lease on "a" only
        assert pool.expire(time.monotonic() + 301) == ["a", "b"]  # the TTL (300 s) passed
        for key, token in (("b", lapsed), ("a", other), ("a", new_token()), ("a", None)):  # expired, a stranger's
            assert hub.ack(key, token, retry=True)[0] == 404
        assert hub.ack("a", mine, retry=True) == (200, "already acknowledged")
        assert_pool_empty(pool)
    finally:
        hub.close()
