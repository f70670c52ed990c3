"""Child leases the connector keeps per loaded item until every request loaded with it has ended: vLLM may preempt a
request and evict its item from the encoder cache, and the resumed request must then fetch the item again, though the
lease it came with was spent at the first fetch."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from eric_epd.plugins.vllm.leases import LeaseClient
from eric_epd.wire.handles import EmbeddingHandle

logger = logging.getLogger(__name__)


@dataclass
class _Kept:
    handle: EmbeddingHandle | None
    """The child lease, or None while a fetch again has spent it (the fetch's acknowledgement answers the next)."""
    users: set[str] = field(default_factory=set)
    """Requests loaded with the item and not ended."""


class KeptLeases:
    """Scheduler side (one thread). An item's child lease (Eric answers one in place of each acknowledged lease) is
    kept while some request loaded with it lives, and given back when the last ends; at most one per item."""

    def __init__(self, leases: LeaseClient) -> None:
        self._leases = leases
        self._kept: dict[str, _Kept] = {}  # vLLM identifier -> its kept lease and users

    def loaded(self, key: str, rid: str, child: EmbeddingHandle | None) -> None:
        """Request `rid` was loaded with item `key`; `child`, if any, is the lease its fetch's acknowledgement
        answered (one kept already for the item goes back: one is enough)."""
        kept = self._kept.get(key)
        if kept is None:
            if child is None:
                return  # nothing to fetch it with again (Eric gave no child, or the bytes came from the store)
            kept = self._kept[key] = _Kept(None)
        if child is not None:
            if kept.handle is not None:
                self._leases.release([kept.handle])
            kept.handle = child
        kept.users.add(rid)

    def handle(self, key: str) -> EmbeddingHandle | None:
        """The kept lease to fetch item `key` again with, if any."""
        kept = self._kept.get(key)
        return None if kept is None else kept.handle

    def spent(self, key: str, handle: EmbeddingHandle) -> None:
        """A fetch again took `handle` (when it is the kept one): its acknowledgement ends it."""
        kept = self._kept.get(key)
        if kept is not None and kept.handle is handle:
            kept.handle = None

    def ended(self, rid: str, keys: list[str]) -> int:
        """Request `rid` ended: the kept leases of items no live request was loaded with go back. Returns how many."""
        back: list[EmbeddingHandle] = []
        for key in keys:
            kept = self._kept.get(key)
            if kept is None or rid not in kept.users:
                continue
            kept.users.discard(rid)
            if not kept.users:
                del self._kept[key]
                if kept.handle is not None:
                    back.append(kept.handle)
        if back:
            self._leases.release(back)
        return len(back)

    def close(self) -> list[EmbeddingHandle]:
        """Forget every kept lease; returns them (the caller gives them back before closing its client)."""
        held = [k.handle for k in self._kept.values() if k.handle is not None]
        self._kept.clear()
        return held
