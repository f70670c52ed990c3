"""What an encode request gets back (ItemAnswer), how the router sizes an item's output (OutputSpec), times a
request (RequestClock) and reserves pool space a caller needs beside its embeddings (Staging)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from eric_epd.eric.processor import PreparedItem
from eric_epd.transfer.pool import PoolEntry
from eric_epd.transfer.producer import Want
from eric_epd.wire.eric import EncodeItem
from eric_epd.wire.handles import EmbeddingHandle

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ItemAnswer:
    """One encoded item's answer: the request item, what preprocessing made of it, and its leased handle (and a
    video's soundtrack, asked with `use_audio_in_video`: an audio item's answer of its own)."""

    request: EncodeItem
    prepared: PreparedItem
    handle: EmbeddingHandle
    soundtrack: ItemAnswer | None = None


@dataclass(frozen=True)
class OutputSpec:
    """What the encoder emits per merged token: `dim` values, or a modality's own width where `widths` gives one
    (Qwen3-Omni: DeepStack image and video rows, narrower audio rows)."""

    dim: int
    dtype: str
    widths: Mapping[str, int] = field(default_factory=dict)

    def width(self, modality: str) -> int:
        """Values per row of a `modality` item."""
        return self.widths.get(modality, self.dim)

    def nbytes(self, num_tokens: int, modality: str = "image") -> int:
        """Bytes of an output of `num_tokens` merged tokens of a `modality` item."""
        return num_tokens * self.width(modality) * _DTYPE_BYTES[self.dtype]


@dataclass
class RequestClock:
    """One encode request's timing: when it began, and the forward time of the batches its items rode in (items
    another request was already encoding are waited for, and their forward is not counted here)."""

    start: float = field(default_factory=time.perf_counter)
    compute_seconds: float = 0.0


def soundtrack_answer(
    request: EncodeItem, track: PreparedItem | None, handles: dict[str, EmbeddingHandle]
) -> ItemAnswer | None:
    """A video's soundtrack as an audio item's answer (same id), or None where none was asked."""
    if track is None:
        return None
    return ItemAnswer(EncodeItem(id=request.id, modality="audio", url=request.url), track, handles[track.hash])


@dataclass
class Staging:
    """Pool space a caller needs beside a request's embeddings (SGLang's copy of a part's rows in its prefill's
    dtype): `want` turns the prepared items into what to reserve; the service fills `entries`, all or none with the
    items it encodes, so no request holds its embeddings while it waits for this space."""

    want: Callable[[list[PreparedItem]], list[Want]]
    wants: list[Want] = field(default_factory=list)
    entries: list[PoolEntry] | None = None
