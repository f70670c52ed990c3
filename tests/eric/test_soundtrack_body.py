"""`use_audio_in_video` on POST /v1/encode: the body's field is checked (a boolean, on a video, for a model that
takes audio), and an answer whose video carries its soundtrack survives the wire schema the gateway decodes with."""

from __future__ import annotations

import json

import msgspec
import pytest

from eric_epd.common.errors import ApiError
from eric_epd.eric.encode_body import parse_encode_body
from eric_epd.wire.eric import EncodeAnswer, EncodedItem, EncodeItem, decode_answer
from eric_epd.wire.handles import EmbeddingHandle

OMNI = ("image", "video", "audio")


def _body(**item: object) -> bytes:
    return json.dumps({"items": [{"modality": "video", "url": "data:video/mp4;base64,AA==", **item}]}).encode()


def test_a_video_may_ask_for_its_soundtrack_of_a_model_that_takes_audio() -> None:
    (item,) = parse_encode_body(_body(use_audio_in_video=True), OMNI, 8)
    assert item == EncodeItem(id="0", modality="video", url="data:video/mp4;base64,AA==", use_audio_in_video=True)
    assert parse_encode_body(_body(), OMNI, 8)[0].use_audio_in_video is False
    assert b"use_audio_in_video" not in msgspec.json.encode(parse_encode_body(_body(), OMNI, 8)[0])


@pytest.mark.parametrize(
    ("body", "modalities", "message"),
    [
        (_body(use_audio_in_video=True), ("image", "video"), "this model takes no audio"),
        (_body(use_audio_in_video=1), OMNI, "must be a boolean"),
        (_body(use_audio_in_video=True, modality="image"), OMNI, "is for a video, not 'image'"),
    ],
)
def test_a_soundtrack_asked_wrongly_is_a_400(body: bytes, modalities: tuple[str, ...], message: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_encode_body(body, modalities, 8)
    assert err.value.status == 400 and message in err.value.message


def _encoded(modality: str, digit: str, rows: int, soundtrack: EncodedItem | None = None) -> EncodedItem:
    handle = EmbeddingHandle(digit * 64, (rows, 64), "float32", rows * 256, "http://eric", "i", "http://eric/e")
    return EncodedItem(
        "v",
        modality,
        digit * 64,
        [rows, 64],
        "float32",
        rows,
        [1, 1, rows],
        handle,  # type: ignore[arg-type]
        placement="media",
        soundtrack=soundtrack,
    )


def test_an_answer_with_a_soundtrack_decodes_as_sent() -> None:
    answer = EncodeAnswer("m", [_encoded("video", "a", 12, _encoded("audio", "b", 75))])
    decoded = decode_answer(msgspec.json.encode(answer))
    assert decoded == answer and decoded.items[0].soundtrack.hash == "b" * 64  # type: ignore[union-attr]
    assert b"soundtrack" not in msgspec.json.encode(_encoded("video", "a", 12))
