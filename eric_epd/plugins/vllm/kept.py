"""Child leases the connector keeps per loaded item until every request loaded with it has ended: vLLM may preempt a
request and evict its item from the encoder cache, and the resumed request must then fetch the item again, though the
lease it came with was spent at the first fetch. Eric makes them soft: they yield when its pool needs the room."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from eric_epd.plugins.vllm.leases import LeaseClient
from eric_epd.wire.handles import EmbeddingHandle


@dataclass
class _Kept:
    handle: EmbeddingHandle | None
    """The child lease, or None while a fetch again has spent it (the fetch's acknowledgement answers the next)."""
    names: set[str] = field(default_factory=set)
    """Every vLLM identifier of the item (one lease may name two: aliases.py)."""
    users: set[str] = field(default_factory=set)
    """Requests loaded with the item and not ended."""


class KeptLeases:
    """Scheduler side (one thread). An item's child lease (Eric answers one in place of each acknowledged lease) is
    kept while some request loaded with it lives, and given back when the last ends; at most one per item. Left to
    their TTL at shutdown (soft: they hold no room Eric needs)."""

    def __init__(self, leases: LeaseClient) -> None:
        self._leases = leases
        self._kept: dict[str, _Kept] = {}  # each of an item's vLLM identifiers -> its one kept lease and users

    def loaded(self, names: Iterable[str], rid: str, child: EmbeddingHandle | None) -> None:
        """Request `rid` was loaded with the item staged under `names`; `child`, if any, is the lease its fetch's
        acknowledgement answered (one kept already for the item goes back: one is enough)."""
        names = set(names)
        kept = next((self._kept[n] for n in names if n in self._kept), None)
        if kept is None:
            if child is None:
                return  # nothing to fetch it with again (Eric gave no child: a lapsed or spent lease, an older Eric)
            kept = _Kept(None)
        if child is not None:
            if kept.handle is not None:
                self._leases.release([kept.handle], quiet=True)
            kept.handle = child
        kept.names |= names
        kept.users.add(rid)
        self._kept.update(dict.fromkeys(kept.names, kept))

    def handle(self, key: str) -> EmbeddingHandle | None:
        """The kept lease to fetch item `key` again with, if any."""
        kept = self._kept.get(key)
        return None if kept is None else kept.handle

    def spent(self, key: str, handle: EmbeddingHandle) -> None:
        """A fetch again took `handle` (when it is the kept one): its acknowledgement ends it."""
        kept = self._kept.get(key)
        if kept is not None and kept.handle is handle:
            kept.handle = None

    def ended(self, rid: str, keys: Iterable[str]) -> None:
        """Request `rid` ended: the kept leases of items no live request was loaded with go back."""
        back: list[EmbeddingHandle] = []
        for key in keys:
            kept = self._kept.get(key)
            if kept is None or rid not in kept.users:
                continue
            kept.users.discard(rid)
            if not kept.users:
                for name in kept.names:
                    self._kept.pop(name, None)
                if kept.handle is not None:
                    back.append(kept.handle)
        if back:
            self._leases.release(back, quiet=True)  # soft: one may have lapsed or yielded to space meanwhile
