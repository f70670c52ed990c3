"""Gateway↔Eric: POST /v1/encode, its body and its answer (leases are given back with `wire.handles.AckBody`);
Eric parses and answers with these, the gateway builds and decodes them."""

from __future__ import annotations

import msgspec

from eric_epd.wire.handles import EmbeddingHandle


class EncodeItem(msgspec.Struct, frozen=True):
    """One media item to encode: a caller-chosen id (echoed back), its modality and its URL (http(s), data, file)."""

    id: str
    modality: str
    url: str


class EncodeBody(msgspec.Struct, frozen=True):
    """POST /v1/encode."""

    items: list[EncodeItem]


class EncodedItem(msgspec.Struct, frozen=True, omit_defaults=True):
    """One encoded item: where its embedding rows wait ([num_tokens, width] of `dtype`) and how the engine places
    them (grid, and for videos the seconds per temporal patch and the sampled frames' timestamps)."""

    id: str
    modality: str
    hash: str
    shape: list[int]
    dtype: str
    num_tokens: int
    grid_thw: list[int]
    handle: EmbeddingHandle
    second_per_grid_ts: float | None = None
    timestamps: list[float] | None = None


class EncodeAnswer(msgspec.Struct, frozen=True):
    """The answer to POST /v1/encode: every item, in the body's order."""

    model: str
    items: list[EncodedItem]


def encode_body(items: list[EncodeItem]) -> bytes:
    """The JSON of a POST /v1/encode body."""
    return msgspec.json.encode(EncodeBody(items))


def decode_answer(content: bytes) -> EncodeAnswer:
    """An Eric's answer, checked against the schema (msgspec.ValidationError or DecodeError otherwise)."""
    return msgspec.json.decode(content, type=EncodeAnswer)
