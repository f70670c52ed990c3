"""The embedding pool: one preallocated shared-memory segment, addressed by content hash, bounded, leased.

Workers write embeddings straight into it (rank 0, at offsets the router reserved); transfer backends register it
once; consumers read from it and acknowledge. An entry is freed when every lease is acknowledged or its TTL passes.
Each lease is a capability: an unguessable token that alone reads, extends (child leases) or releases it.
Every party that may still read or write a region without a lease (engine batches, store reads and puts, SGLang
sends) holds its fence: a freed entry leaves its hash at once, but its region is reused only when the last hold ends.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from eric_epd.common.errors import ApiError
from eric_epd.common.shm import Segment
from eric_epd.transfer.free_list import FreeList, span

logger = logging.getLogger(__name__)

MAX_CHILD_LEASES = 64
"""Most child leases one lease may add (one per tensor-parallel rank of a consumer)."""
MAX_ENDED_LEASES = 32768
"""Leases ended by their own ack the pool remembers: an ack retried after a lost answer is told it took effect."""


class LeaseError(ApiError):
    """A lease operation refused: `status` is the HTTP status to answer with."""


def new_token() -> str:
    """An unguessable lease token (128 bits)."""
    return secrets.token_urlsafe(16)


@dataclass
class PoolEntry:
    """One embedding's region of the pool: where and what it is, whether it is written, and its leases."""

    hash: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    generation: int = 0
    """Unique per reservation: a handle to a freed and re-encoded entry no longer matches."""
    ready: bool = False
    """False while the workers have not written it yet."""
    leases: dict[str, str] = field(default_factory=dict)
    """Outstanding lease token -> the token of the lease it was added from (itself for a root lease)."""
    lease_expiry: dict[str, float] = field(default_factory=dict)
    """Outstanding lease token -> when it lapses unacknowledged (each lease has its own TTL)."""
    children: dict[str, int] = field(default_factory=dict)
    """Root token -> child leases added from it (bounded by MAX_CHILD_LEASES)."""
    outstanding: Counter[str] = field(default_factory=Counter)
    """Root token -> its leases (itself and its children) not ended yet; at 0 the root's child count goes too."""
    soft: set[str] = field(default_factory=set)
    """Outstanding leases that yield to space (kept to read again, maybe): see `yields`."""
    expires_at: float = 0.0
    fence: Counter[str] = field(default_factory=Counter)
    """Party kind -> parties that may still read or write the region and cannot be stopped (engine batches, store
    reads and puts, SGLang sends): the region is reused only once every one has ended its hold."""

    def holds(self, token: str | None) -> bool:
        """True if `token` names an outstanding lease on this (written) entry."""
        return self.ready and token is not None and token in self.leases

    def yields(self) -> bool:
        """Whether only soft leases hold this written, unfenced entry: a reservation that needs room evicts it (its
        consumer's next read then fails its proof, the ack)."""
        return self.ready and not self.fence and bool(self.leases) and self.soft.issuperset(self.leases)

    def end_lease(self, token: str) -> None:
        """End the outstanding lease `token` (acknowledged or lapsed): a popular entry, leased and acked without
        end, keeps no bookkeeping of the roots whose leases have all ended."""
        root = self.leases.pop(token)
        self.lease_expiry.pop(token, None)
        self.soft.discard(token)
        self.outstanding[root] -= 1
        if self.outstanding[root] <= 0:
            del self.outstanding[root]
            self.children.pop(root, None)


class Hold:
    """One party's claim on an entry's region (see EmbeddingPool.hold): end() lets it go (idempotent); usable as a
    context manager."""

    def __init__(self, pool: EmbeddingPool, entry: PoolEntry, party: str) -> None:
        self._pool, self.entry, self.party = pool, entry, party
        self._ended = False

    def end(self) -> None:
        """This party no longer reads or writes the region; the last hold of a freed entry frees the region."""
        if not self._ended:
            self._ended = True
            self._pool._unhold(self.entry, self.party)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class EmbeddingPool:
    """Owned by the router process (single-threaded asyncio use; not thread-safe by design)."""

    def __init__(
        self, name: str, nbytes: int, ttl_s: float, keep_acked_bytes: int = 0, on_free: Callable[[], None] | None = None
    ) -> None:
        self._shm: Segment | None = Segment(name=name, create=True, size=nbytes)
        self.name = name
        self.nbytes = nbytes
        self.ttl_s = ttl_s
        self.array = np.ndarray((nbytes,), dtype=np.uint8, buffer=self._shm.buf)
        self.base_addr = self.array.ctypes.data
        self._free = FreeList(nbytes)
        self._entries: dict[str, PoolEntry] = {}
        self._held: dict[str, PoolEntry] = {}
        """The entries not kept as content cache (reserved, written, leased): all `expire` looks at, so a cache of
        hundreds of thousands of acknowledged entries costs its once-a-second pass nothing."""
        self._generations = itertools.count(1)
        # Acknowledged entries kept as a content cache (LRU, first to go when space is needed), up to this budget.
        self._keep_acked_bytes = keep_acked_bytes
        self._acked: OrderedDict[str, PoolEntry] = OrderedDict()
        self._acked_bytes = 0  # in span() bytes, like the free list: used_bytes is exact
        self._detached: dict[int, PoolEntry] = {}  # generation -> freed entry whose region a hold still fences
        self._on_free = on_free  # called when a fenced region returns (space waiters wake)
        self._ended: OrderedDict[str, str] = OrderedDict()  # token of a lease its own ack ended -> its hash
        self.evictions = 0
        """Entries dropped for room or the cache budget: cached (acknowledged) ones, or ones only soft leases hold."""

    @property
    def used_bytes(self) -> int:
        """Bytes held for consumers (leased, in flight or detached; not the cache), in span() units; 0 if none."""
        return self.nbytes - self._free.free_bytes - self._acked_bytes

    @property
    def cached_bytes(self) -> int:
        """Bytes of acknowledged entries kept as the content cache (in `span` units)."""
        return self._acked_bytes

    @property
    def cache_budget(self) -> int:
        """Most bytes the content cache of acknowledged entries may keep (`keep_acked_bytes`)."""
        return self._keep_acked_bytes

    def _evict_oldest(self) -> None:
        self.release(next(iter(self._acked)))
        self.evictions += 1

    def __len__(self) -> int:
        """Entries held for consumers, detached reservations included (not the acknowledged cache entries)."""
        return len(self._entries) + len(self._detached) - len(self._acked)

    def get(self, key: str) -> PoolEntry | None:
        """The entry under this content hash, written or not, or None."""
        return self._entries.get(key)

    def written(self, key: str) -> bool:
        """Whether an entry under this content hash is written (committed, leased or kept as cache): a lease on it
        holds at once, no encode needed. Changes nothing (no LRU touch, no TTL)."""
        return (entry := self._entries.get(key)) is not None and entry.ready

    def reserve(self, key: str, nbytes: int, shape: tuple[int, ...], dtype: str) -> PoolEntry | None:
        """Space for an embedding the workers will write; None when the pool is full."""
        if key in self._entries:
            raise KeyError(f"{key} already in the pool")
        offset = self._free.allocate(nbytes)
        while offset is None and self._acked:  # make room from the cache of acknowledged entries
            self._evict_oldest()
            offset = self._free.allocate(nbytes)
        if offset is None:
            offset = self._evict_yielding(nbytes)
        if offset is None:
            return None
        entry = PoolEntry(
            key,
            offset,
            nbytes,
            shape,
            dtype,
            generation=next(self._generations),
            expires_at=time.monotonic() + self.ttl_s,
        )
        self._entries[key] = self._held[key] = entry
        return entry

    def _evict_yielding(self, nbytes: int) -> int | None:
        """Room for `nbytes` from entries only soft leases hold (oldest reserved first), when the content cache gave
        too little; None, evicting none, if all of them would not be enough. Walks the held entries (pool full only)."""
        yielding = [e for e in self._held.values() if e.yields()]
        if self._free.free_bytes + sum(span(e.nbytes) for e in yielding) < span(nbytes):
            return None
        for entry in yielding:
            self.release(entry.hash)
            self.evictions += 1
            if (offset := self._free.allocate(nbytes)) is not None:
                return offset
        return None

    def commit(self, key: str) -> None:
        """Mark the entry written (the workers finished it); leases on it now hold."""
        self._entries[key].ready = True

    def lease(self, key: str) -> tuple[PoolEntry, str]:
        """One more consumer will read this entry: (entry, the new lease's token); the TTL restarts."""
        entry = self._entries[key]
        if self._acked.pop(key, None) is not None:  # a cached entry is wanted again
            self._acked_bytes -= span(entry.nbytes)
            self._held[key] = entry
        token = new_token()
        entry.leases[token] = token
        entry.outstanding[token] += 1
        entry.expires_at = entry.lease_expiry[token] = time.monotonic() + self.ttl_s
        return entry, token

    def refresh(self, key: str, token: str) -> bool:
        """Restart the TTL of the lease `token` names (its handle is about to be answered: the consumer's time to
        read and acknowledge counts from then, however long the request took); False if it is no longer held."""
        entry = self._entries.get(key)
        if entry is None or not entry.holds(token):
            return False
        entry.lease_expiry[token] = time.monotonic() + self.ttl_s
        entry.expires_at = max(entry.expires_at, entry.lease_expiry[token])
        return True

    def holder(self, key: str, token: str | None) -> PoolEntry:
        """The entry `token` holds a lease on; LeaseError 404 (the same for an unknown hash and a wrong token, so a
        stranger learns nothing about what is held)."""
        entry = self._entries.get(key)
        if entry is None or not entry.holds(token):
            raise LeaseError(
                404,
                f"no lease with this token on embedding {key} (never encoded here, already "
                "acknowledged, expired, or a wrong token)",
            )
        return entry

    def add_leases(self, key: str, token: str | None, count: int, soft: bool = False) -> list[str]:
        """`count` child leases of the lease `token` names (e.g. one per tensor-parallel rank of a consumer); a
        lease and its children may add at most MAX_CHILD_LEASES in all. `soft` ones yield to space (PoolEntry.soft)."""
        entry = self.holder(key, token)
        assert token is not None
        root = entry.leases[token]
        added = entry.children.get(root, 0)
        if count < 1 or added + count > MAX_CHILD_LEASES:
            raise LeaseError(
                400, f"a lease may add 1 to {MAX_CHILD_LEASES} child leases in all; {added} added, {count} more asked"
            )
        entry.children[root] = added + count
        tokens = [new_token() for _ in range(count)]
        entry.leases.update((t, root) for t in tokens)
        if soft:
            entry.soft.update(tokens)
        entry.outstanding[root] += count
        entry.expires_at = time.monotonic() + self.ttl_s
        entry.lease_expiry.update((t, entry.expires_at) for t in tokens)
        return tokens

    def ack(self, key: str, token: str | None) -> bool:
        """The consumer holding `token` is done: exactly that lease ends (repeating it changes nothing); the entry
        goes when no lease is left. False if no such lease is held."""
        entry = self._entries.get(key)
        if entry is None or not entry.holds(token):
            return False
        entry.end_lease(token)  # type: ignore[arg-type]
        self._ended[token] = key  # type: ignore[index]
        while len(self._ended) > MAX_ENDED_LEASES:
            self._ended.popitem(last=False)
        if not entry.leases:
            self._retire(entry)
        return True

    def acked_before(self, key: str, token: str | None) -> bool:
        """True if `token`'s lease on `key` was ended by its own ack (one of the last MAX_ENDED_LEASES): a repeated
        ack then took effect the first time. False for an expired, released or unknown lease."""
        return token is not None and self._ended.get(token) == key

    def _retire(self, entry: PoolEntry) -> None:
        """No lease left: free the entry, or keep it as cache within the budget (evicting the oldest)."""
        entry.children.clear()
        entry.outstanding.clear()
        if span(entry.nbytes) > self._keep_acked_bytes:
            self.release(entry.hash)
            return
        self._acked[entry.hash] = entry
        self._held.pop(entry.hash, None)
        self._acked_bytes += span(entry.nbytes)
        while self._acked_bytes > self._keep_acked_bytes:
            self._evict_oldest()

    def release(self, key: str, generation: int | None = None) -> None:
        """Free an entry now (failed encode, last ack, expiry): it leaves its hash at once (the hash can be reserved
        again), and its region returns when no hold fences it any more. With `generation`, only that reservation: a
        caller holding an entry that was freed and re-encoded meanwhile must not free the newer one."""
        entry = self._entries.get(key)
        if entry is None or (generation is not None and entry.generation != generation):
            if entry is not None:
                logger.debug(
                    "release of %s generation %d skipped: generation %d holds it now", key, generation, entry.generation
                )
            return
        del self._entries[key]
        self._held.pop(key, None)
        if self._acked.pop(key, None) is not None:
            self._acked_bytes -= span(entry.nbytes)
        if entry.fence:
            self._detached[entry.generation] = entry  # still read or written: held (in used_bytes) until unfenced
        else:
            self._free.free(entry.offset, entry.nbytes)

    def hold(self, entry: PoolEntry, party: str) -> Hold:
        """Fence the entry's region for a party that may read or write it and cannot be stopped (an engine batch, a
        store read or put, an SGLang send): until the hold ends, a release (ack, expiry, failure, eviction) takes
        the entry off its hash but never hands its region to anyone else."""
        if self._entries.get(entry.hash) is not entry and self._detached.get(entry.generation) is not entry:
            raise KeyError(f"{entry.hash} generation {entry.generation} is not in the pool")
        entry.fence[party] += 1
        return Hold(self, entry, party)

    def _unhold(self, entry: PoolEntry, party: str) -> None:
        entry.fence[party] -= 1
        if entry.fence[party] <= 0:
            del entry.fence[party]
        if not entry.fence and self._detached.get(entry.generation) is entry:
            del self._detached[entry.generation]
            self._free.free(entry.offset, entry.nbytes)
            if self._on_free is not None:
                self._on_free()

    def audit(self) -> str | None:
        """None if the accounting adds up exactly (free ranges disjoint, coalesced and within the pool; held space
        = the entries' spans; cached bytes = the cached entries' spans; nothing held = one free range, used 0);
        else what does not (for tests)."""
        ranges = self._free.ranges()
        held = [*self._entries.values(), *self._detached.values()]
        spans = sum(span(e.nbytes) for e in held)
        problems = []
        if (
            any(a + n >= b for (a, n), (b, _) in itertools.pairwise(ranges))
            or any(n <= 0 for _, n in ranges)
            or (ranges and ranges[-1][0] + ranges[-1][1] > self.nbytes)
        ):
            problems.append(f"free ranges overlap, touch or leave the pool: {ranges[:8]}")
        if self.nbytes - self._free.free_bytes != spans:
            problems.append(f"{self.nbytes - self._free.free_bytes} bytes allocated, entries span {spans}")
        if self._acked_bytes != sum(span(e.nbytes) for e in self._acked.values()):
            problems.append(f"cached_bytes {self._acked_bytes} != the cached entries' spans")
        if self._held.keys() != self._entries.keys() - self._acked.keys():
            problems.append(f"held entries {len(self._held)} are not the {len(self._entries)} less the cached ones")
        if not held and (self.used_bytes != 0 or ranges != [(0, self.nbytes)]):
            problems.append(f"nothing held, yet used_bytes={self.used_bytes}, free ranges {ranges[:8]}")
        return "; ".join(problems) or None

    def expire(self, now: float | None = None) -> list[str]:
        """Free ready entries whose TTL passed (their regions return once unfenced), and retire those whose last
        lease lapsed; return their hashes."""
        now = time.monotonic() if now is None else now
        live = [e for e in self._held.values() if e.ready]
        gone = [e.hash for e in live if e.expires_at <= now]
        # others may still read the rest: only the leases nobody acked in time lapse, and an entry whose last
        # lease lapsed so is retired now (freed, or kept as content cache), not at its newest lease's TTL
        lapsed = [e for e in live if e.expires_at > now and self._lapse(e, now) and not e.leases]
        for key in gone:
            self.release(key)
        for entry in lapsed:
            self._retire(entry)
        if gone or lapsed:
            logger.info("expired %d pool entries, retired %d whose last lease lapsed", len(gone), len(lapsed))
        return gone + [e.hash for e in lapsed]

    @staticmethod
    def _lapse(entry: PoolEntry, now: float) -> bool:
        """Drop the entry's leases whose own TTL passed (a consumer that never acked): a popular entry, leased anew
        all the time, does not keep every abandoned lease forever. Whether any lapsed."""
        tokens = [t for t, at in entry.lease_expiry.items() if at <= now]
        for token in tokens:
            entry.end_lease(token)
        return bool(tokens)

    def view(self, entry: PoolEntry) -> np.ndarray:
        """The entry's bytes: a view on the pool, not a copy."""
        return self.array[entry.offset : entry.offset + entry.nbytes]

    def close(self) -> None:
        """Unmap and unlink the segment; idempotent."""
        if self._shm is None:
            return
        self._shm.unlink()
        self._shm.close()  # unmaps once no view is left (Segment tolerates live exports)
        self._shm = None
