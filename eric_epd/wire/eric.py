"""Gateway↔Eric: POST /v1/encode, its body and its answer (leases are given back with `wire.handles.AckBody`);
Eric parses and answers with these, the gateway builds and decodes them."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from eric_epd.wire.handles import EmbeddingHandle

Placement = Literal["grid", "media"]
"""How the engine places an item's rows in the prompt. "grid": from metadata alone (the Qwen families: vLLM's
metadata-only `image_embeds`/`video_embeds` part carries the grid, and its placeholder follows from it). "media": from
the media itself (the generic path: the engine gets the image, as a data: URL, with the content hash as its `uuid`;
its own processor computes the placeholder and the connector fills it with Eric's rows)."""
GRID: Placement = "grid"
MEDIA: Placement = "media"

Modality = Literal["image", "video", "audio"]
"""What one item is: Eric's router takes the modalities its model's processor does (ModelFacts.modalities), and the
generic path's engine items carry this type (eric/generic.GenericSpec), so another one never decodes."""


class EncodeItem(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One media item to encode: its modality, its URL (http(s), data, file) and a caller-chosen id, echoed back (Eric
    numbers an item sent without one by its place in the body)."""

    modality: Modality
    url: str
    id: str = ""
    use_audio_in_video: bool = False
    """A video only, for a model that takes audio: its soundtrack is encoded too, as vLLM's `use_audio_in_video`
    has it (the first audio stream of the same bytes, decoded as an audio item), and answered as its `soundtrack`."""


class EncodeBody(msgspec.Struct, frozen=True):
    """POST /v1/encode."""

    items: list[EncodeItem]


class EncodedItem(msgspec.Struct, frozen=True, omit_defaults=True):
    """One encoded item: where its embedding rows wait ([num_tokens, width] of `dtype`) and how the engine places
    them (`placement`; for "grid" the grid, and for videos the seconds per temporal patch and the sampled frames'
    timestamps)."""

    id: str
    modality: Modality
    hash: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    """The content hash (256-bit BLAKE3, hex): it becomes the engine's item identifier (`uuid`), so the schema pins
    its form."""
    shape: list[int]
    dtype: str
    num_tokens: int
    grid_thw: list[int]
    handle: EmbeddingHandle
    second_per_grid_ts: float | None = None
    timestamps: list[float] | None = None
    placement: Placement = GRID
    """Left out on the wire when "grid" (what every Eric answered before the generic path)."""
    soundtrack: EncodedItem | None = None
    """A video asked with `use_audio_in_video`: its soundtrack, an audio item of its own (hash, rows, handle)."""


class EncodeAnswer(msgspec.Struct, frozen=True):
    """The answer to POST /v1/encode: every item, in the body's order."""

    model: str
    items: list[EncodedItem]


class ModelCard(msgspec.Struct, frozen=True):
    """What the gateway reads of an Eric's GET /v1/models card (other fields ignored): what it encodes, how the
    engine places its items (known before any encode: the gateway inlines the media first when they go as media),
    and whether the model takes audio at all (Eric encoding it or not)."""

    modalities: list[str]
    placement: Placement = GRID
    takes_audio: bool | None = None
    """None: an Eric that does not say (the engine's own answer then tells the client)."""


class _Models(msgspec.Struct, frozen=True):
    data: list[ModelCard]


def encode_body(items: list[EncodeItem]) -> bytes:
    """The JSON of a POST /v1/encode body."""
    return msgspec.json.encode(EncodeBody(items))


def decode_answer(content: bytes) -> EncodeAnswer:
    """An Eric's answer, checked against the schema (msgspec.ValidationError or DecodeError otherwise)."""
    return msgspec.json.decode(content, type=EncodeAnswer)


def decode_card(content: bytes) -> ModelCard:
    """The first card of an Eric's GET /v1/models answer (msgspec.ValidationError or DecodeError otherwise; an empty
    list is a ValidationError too)."""
    cards = msgspec.json.decode(content, type=_Models).data
    if not cards:
        raise msgspec.ValidationError("GET /v1/models lists no model")
    return cards[0]
