"""The raw-bytes alias: a bounded LRU from an item's fetched bytes (and every setting that changes what they prepare
into) to the content hash they prepared into last time, with the item's metadata but not its tensors. A resent item
(multi-turn chats resend every image each turn) whose embedding is still in this Eric's pool is answered without
being decoded, preprocessed or hashed again; a resent data: URL (keyed by its text) is not even base64-decoded.

An alias is never wrong, only possibly useless: the same bytes under the same settings always prepare into the same
content hash, so an entry stays until the LRU drops it; whether its embedding is still in the pool is asked at each
lookup (`find`), and a light item (its tensors left out) is only ever answered from a lease, never submitted. The
media limits are fixed for the process, so bytes accepted once are accepted again; a hit decodes nothing, so it does
not count against its request's video decode budget."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import blake3
import numpy as np

from eric_epd.common.errors import OFF_LOOP_BYTES
from eric_epd.eric.processor import PreparedItem
from eric_epd.wire.eric import EncodeItem


def light(prepared: PreparedItem) -> PreparedItem:
    """`prepared` without its tensors (an empty pixel array of the same dtype and row width), marked `aliased`; the
    metadata an answer reads (grid, token count, timestamps, feature frames...) stays."""
    pixels = np.asarray(prepared.item.pixel_values)
    empty = np.empty((0, *pixels.shape[1:]), pixels.dtype)
    return PreparedItem(prepared.hash, dataclasses.replace(prepared.item, pixel_values=empty), aliased=True)


class RawAlias:
    """Raw-bytes key -> the light PreparedItem those bytes prepared into, the `max_entries` most recently used.
    `salts`: each modality's content-hash salt (Processor.salts: the model's fingerprint, the modality, its
    processor's fingerprint and the video sampling), so a key changes with every setting the hash does. Use from
    the event loop only."""

    def __init__(self, max_entries: int, salts: Mapping[str, bytes]) -> None:
        if max_entries < 1:
            raise ValueError(f"an alias holds at least 1 entry, got {max_entries}")
        self.max_entries = max_entries
        self._salts = dict(salts)
        self._entries: OrderedDict[bytes, PreparedItem] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, modality: str, data: bytes, sglang: bool = False, soundtrack: bool = False) -> bytes | None:
        """BLAKE3 over the modality's salt, the modality, `sglang` (audio as SGLang reads it hashes otherwise),
        whether it is a video's soundtrack (audio decoded from a video's bytes) and the bytes; None for a modality
        the model does not take (nothing to alias: preparing it fails)."""
        return self._key(modality, "bytes", data, sglang, soundtrack)

    def data_url_key(self, item: EncodeItem, sglang: bool = False) -> bytes | None:
        """The key of a data: URL's whole text (what it decodes into follows from it, the media limits being fixed),
        so a resent one is found without decoding its base64; None for another URL, an item that also asks for its
        soundtrack (keyed by its bytes, with it) or a modality the model does not take. Keys of texts and of bytes
        never meet: each names its kind before the payload."""
        if item.use_audio_in_video or not item.url.startswith("data:"):
            return None
        return self._key(item.modality, "data-url", item.url.encode("utf-8", "surrogatepass"), sglang, False)

    def _key(self, modality: str, kind: str, payload: bytes, sglang: bool, soundtrack: bool) -> bytes | None:
        salt = self._salts.get(modality)
        if salt is None:
            return None
        h = blake3.blake3(salt, max_threads=1)
        h.update(f"\0{modality}\0sglang={int(sglang)}\0soundtrack={int(soundtrack)}\0{kind}\0".encode())
        h.update(payload)
        return h.digest()

    def find(self, key: bytes | None, ready: Callable[[str], bool]) -> PreparedItem | None:
        """The light item `key` names if `ready(its hash)` (its embedding is written and held in the pool), else
        None: the item must be prepared in full. A found entry becomes the most recently used."""
        prepared = self._entries.get(key) if key is not None else None
        if prepared is None or not ready(prepared.hash):
            return None
        self._entries.move_to_end(key)  # type: ignore[arg-type]
        return prepared

    def remember(self, key: bytes | None, prepared: PreparedItem) -> None:
        """Alias `key` to a successfully prepared item (kept light), dropping the least recently used past the
        bound."""
        if key is None:
            return
        self._entries[key] = prepared if prepared.aliased else light(prepared)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


async def data_url_keys(alias: RawAlias, items: list[EncodeItem], sglang: bool = False) -> list[bytes | None]:
    """Each item's data: URL key (RawAlias.data_url_key), hashed in a thread when the texts are many bytes, as
    alias_keys hashes bytes."""

    def keys() -> list[bytes | None]:
        return [alias.data_url_key(item, sglang) for item in items]

    size = sum(len(item.url) for item in items if item.url.startswith("data:"))
    return keys() if size <= OFF_LOOP_BYTES else await asyncio.to_thread(keys)


async def alias_keys(
    alias: RawAlias,
    jobs: list[tuple[str, bytes]],
    first_soundtrack: int,
    sglang: bool = False,
    given: Sequence[bytes | None] = (),
) -> list[bytes | None]:
    """Each (modality, bytes) job's key: `given[i]` where there is one (a data: URL's), else its bytes'; jobs from
    `first_soundtrack` on are videos' soundtracks. Hashed in a thread when the bytes are many (BLAKE3 lets go of the
    GIL), so a large video does not stall the event loop."""
    given = [*given, *[None] * (len(jobs) - len(given))]
    hashed = [i for i, key in enumerate(given) if key is None]

    def keys() -> list[bytes | None]:
        out = list(given)
        for i in hashed:
            out[i] = alias.key(jobs[i][0], jobs[i][1], sglang, i >= first_soundtrack)
        return out

    return keys() if sum(len(jobs[i][1]) for i in hashed) <= OFF_LOOP_BYTES else await asyncio.to_thread(keys)
