"""POST /v1/encode's body, decoded with the wire schema (`wire.eric.EncodeBody`) and checked against this Eric's
model: every problem a 400 that names the item and the field."""

from __future__ import annotations

import re

import msgspec

from eric_epd.common.errors import ApiError, parse_body
from eric_epd.common.jsonbody import MAX_ID, MAX_TOKENS, MAX_URL, clip, count_tokens
from eric_epd.wire.eric import EncodeBody, EncodeItem

_WHERE = re.compile(r"- at `\$\.items\[(\d+)\](?:\.(\w+))?`$")
_MISSING = re.compile(r"missing required field `(\w+)`")
_ENUM = re.compile(r"^Invalid enum value (.*) - at")
_FIELD_MUST = {"url": "a non-empty string", "id": "a string", "use_audio_in_video": "a boolean"}
_SHAPE = 'body must be an object with a list field "items"'


def parse_encode_body(body: bytes, modalities: tuple[str, ...], max_items: int) -> list[EncodeItem]:
    """The items of {"items": [{id?, modality, url, use_audio_in_video?}, ...]}: JSON within jsonbody's token bound,
    decoded into the wire schema, then checked against the model's modalities and the limits. Fields the schema does
    not name are skipped unread (their nesting, numbers and bytes are not checked: nothing uses them)."""
    items = _decoded(body)
    if items is None:  # not a well-formed EncodeBody: parsed as plain JSON, for an error that names the problem
        data = parse_body(body)
        try:
            items = msgspec.convert(data, EncodeBody).items
        except msgspec.ValidationError as e:
            raise ApiError(400, _worded(str(e), modalities)) from e
    if not items:
        raise ApiError(400, '"items" is empty: send at least one item')
    if len(items) > max_items:
        raise ApiError(400, f"too many items: {len(items)} > {max_items}")
    return [_checked(i, item, modalities) for i, item in enumerate(items)]


def _decoded(body: bytes) -> list[EncodeItem] | None:
    """The items of a body that decodes straight into EncodeBody within jsonbody's token bound, else None. msgspec
    builds only the schema's fields (3.3x faster than orjson's plain parse on 10 MB of data: URLs, one-off) and
    skips the others without building them, so their nesting costs nothing; one nested past Python's recursion
    limit fails here, and the plain parse then refuses it for its depth."""
    if count_tokens(body, MAX_TOKENS) > MAX_TOKENS:
        return None
    try:
        return msgspec.json.decode(body, type=EncodeBody).items
    except (msgspec.DecodeError, RecursionError):
        return None


def _worded(error: str, modalities: tuple[str, ...]) -> str:
    """msgspec's validation error in this route's words: which item, which field, what it must be."""
    where = _WHERE.search(error)
    if where is None:
        return _SHAPE
    index, field = int(where[1]), where[2]
    missing = _MISSING.search(error)
    field = field or (missing[1] if missing else None)
    if field == "modality":
        value = _ENUM.search(error)
        named = _cut(value[1]) if value else "None" if missing else "(not a string)"
        return f"item {index}: unsupported modality {named}; expected one of {list(modalities)}"
    if field in _FIELD_MUST:
        return f"item {index}: field '{field}' must be {_FIELD_MUST[field]}"
    return f"item {index} must be an object"


def _cut(text: str, limit: int = 80) -> str:
    """A client's value as msgspec quoted it, cut as jsonbody.clip cuts one."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _checked(index: int, item: EncodeItem, modalities: tuple[str, ...]) -> EncodeItem:
    """`item` checked against the model and the limits, its id defaulting to its index."""
    if item.modality not in modalities:
        raise ApiError(
            400, f"item {index}: unsupported modality {clip(item.modality)}; expected one of {list(modalities)}"
        )
    if not item.url:
        raise ApiError(400, f"item {index}: field 'url' must be a non-empty string")
    if len(item.url) > MAX_URL and not item.url.startswith("data:"):
        raise ApiError(400, f"item {index}: the url is {len(item.url)} characters long, over the limit of {MAX_URL}")
    if len(item.id) > MAX_ID:
        raise ApiError(400, f"item {index}: the id is {len(item.id)} characters long, over the limit of {MAX_ID}")
    if item.use_audio_in_video and item.modality != "video":
        raise ApiError(400, f"item {index}: 'use_audio_in_video' is for a video, not {clip(item.modality)}")
    if item.use_audio_in_video and "audio" not in modalities:
        raise ApiError(
            400, f"item {index}: this model takes no audio, so not a video's soundtrack ('use_audio_in_video')"
        )
    return item if item.id else msgspec.structs.replace(item, id=str(index))
