"""The media the engines encoded themselves on the gateway's plain path, remembered (bounded) so that a chat's later
turns, which resend them, count only the media the engine has not seen toward --epd-min-items."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from epd_gateway.content import MediaRef

MAX_REMEMBERED = 65536
"""Media keys kept (least recently seen dropped first): 8-byte digests, a few MiB at most."""


class PlainMedia:
    """An item the engine encoded on the plain path sits in its prefix and encoder caches under vLLM's own hash; on
    the EPD path the same item is named by Eric's content hash, which cannot hit them. So a turn whose media the
    engine mostly holds stays plain (it encodes only the new ones and keeps its prefix-cache hit) until the new media
    alone reach --epd-min-items. Keys are the items' routing keys (a digest of the URL or inlined bytes); a key only
    steers this gateway's choice of path, nothing downstream."""

    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._capacity = capacity

    def remember(self, refs: Iterable[MediaRef]) -> None:
        """These items went to the engine on the plain path and it answered."""
        for key in (ref.routing_key for ref in refs):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def unseen(self, refs: Iterable[MediaRef]) -> int:
        """How many of these items the plain path never carried (each one it did counts as recently seen)."""
        count = 0
        for key in (ref.routing_key for ref in refs):
            if key in self._keys:
                self._keys.move_to_end(key)
            else:
                count += 1
        return count
