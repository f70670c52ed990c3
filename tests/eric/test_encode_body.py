"""POST /v1/encode's body is decoded with the wire schema (wire.eric.EncodeBody) and every problem keeps its 400
wording: which item, which field, what it must be."""

from __future__ import annotations

import pytest

from eric_epd.common.errors import ApiError
from eric_epd.eric.encode_body import parse_encode_body
from eric_epd.wire.eric import EncodeItem

IMAGES = ("image", "video")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[]", 'body must be an object with a list field "items"'),
        (b"{}", 'body must be an object with a list field "items"'),
        (b'{"items": 3}', 'body must be an object with a list field "items"'),
        (b'{"items": []}', '"items" is empty: send at least one item'),
        (b'{"items": [3]}', "item 0 must be an object"),
        (b'{"items": [[[[1]]]]}', "item 0 must be an object"),
        (b'{"items": [{"url": "x"}]}', "item 0: unsupported modality None; expected one of ['image', 'video']"),
        (b'{"items": [{"modality": "IMAGE", "url": "x"}]}', "item 0: unsupported modality 'IMAGE'"),
        (b'{"items": [{"modality": "audio", "url": "x"}]}', "item 0: unsupported modality 'audio'"),
        (b'{"items": [{"modality": 5, "url": "x"}]}', "item 0: unsupported modality (not a string)"),
        (
            b'{"items": [{"modality": "image", "url": "x"}, {"modality": "image"}]}',
            "item 1: field 'url' must be a non-empty string",
        ),
        (b'{"items": [{"modality": "image", "url": 3}]}', "item 0: field 'url' must be a non-empty string"),
        (b'{"items": [{"modality": "image", "url": ""}]}', "item 0: field 'url' must be a non-empty string"),
        (b'{"items": [{"modality": "image", "url": "x", "id": 3}]}', "item 0: field 'id' must be a string"),
        (
            b'{"items": [{"modality": "image", "url": "x", "id": "' + b"i" * 300 + b'"}]}',
            "item 0: the id is 300 characters long, over the limit of 256",
        ),
        (b'{"items": [{"modality": "image", "url": "http://a/' + b"b" * 9000 + b'"}]}', "over the limit of 8192"),
        (
            b'{"items": [{"modality": "image", "url": "x", "use_audio_in_video": 1}]}',
            "item 0: field 'use_audio_in_video' must be a boolean",
        ),
        (
            b'{"items": [' + b'{"modality": "image", "url": "x"},' * 8 + b'{"modality": "image", "url": "x"}]}',
            "too many items: 9 > 8",
        ),
        (b'{"items": [{"a": ' + b"[" * 40 + b"]" * 40 + b"}]}", "nested deeper than 32"),
    ],
)
def test_each_problem_is_a_400_naming_it(body: bytes, message: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_encode_body(body, IMAGES, 8)
    assert err.value.status == 400 and message in err.value.message, err.value.message


def test_a_long_modality_is_named_without_being_echoed_whole() -> None:
    with pytest.raises(ApiError) as err:
        parse_encode_body(b'{"items": [{"modality": "' + b"x" * 100_000 + b'", "url": "x"}]}', IMAGES, 8)
    assert "(100002 characters)" in err.value.message and len(err.value.message) < 300, err.value.message


def test_items_decode_to_the_wire_type_numbered_where_no_id_is_sent() -> None:
    body = (
        b'{"items": [{"modality": "image", "url": "data:a", "extra": 1},'
        b' {"modality": "video", "url": "http://h/v.mp4", "id": "b"}]}'
    )
    assert parse_encode_body(body, IMAGES, 8) == [
        EncodeItem(id="0", modality="image", url="data:a"),
        EncodeItem(id="b", modality="video", url="http://h/v.mp4"),
    ]


@pytest.mark.parametrize("depth", [40, 5000])
def test_an_unknown_field_is_skipped_however_deep_or_refused_by_name(depth: int) -> None:
    """A well-formed body decodes straight into the wire schema, skipping unknown fields without building them (a
    nesting of 40 costs nothing there); one nested past Python's recursion limit falls back to the plain parse,
    which names it."""
    body = b'{"items": [{"modality": "image", "url": "data:a", "z": ' + b"[" * depth + b"]" * depth + b"}]}"
    if depth == 40:
        assert parse_encode_body(body, IMAGES, 8) == [EncodeItem(id="0", modality="image", url="data:a")]
        return
    with pytest.raises(ApiError) as err:
        parse_encode_body(body, IMAGES, 8)
    assert err.value.status == 400 and "nested deeper than 32" in err.value.message, err.value.message


def test_a_body_over_the_token_bound_is_refused_before_decoding() -> None:
    items = b",".join([b'{"modality": "image", "url": "x"}'] * 30_000)
    with pytest.raises(ApiError) as err:
        parse_encode_body(b'{"items": [' + items + b"]}", IMAGES, 8)
    assert err.value.status == 400 and "tokens" in err.value.message, err.value.message
