"""A real Eric (router, engine, worker) on the tiny Qwen2.5-Omni checkpoint: one request carrying audio clips (odd
lengths, rates and channel counts), an image and a video is answered with rows, fetched over the transfer path with
each item's lease, equal to transformers' thinker's features on the samples vLLM's loader gives, the decoded image
and the frames Eric samples; the card names all three modalities; bad audio gets a 4xx and the server keeps
serving."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eric_epd.eric.decode import decode_video
from eric_epd.media.limits import MediaLimits
from eric_epd.models.registry import load_processor
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import audio_bytes, data_url, video_bytes, video_with_audio_bytes
from tests.support.helpers_servers import embedding_rows, encode_items
from tests.support.omni_reference import omni_rows
from tests.support.omni_request import RTOL, assert_answered_with, references, request_items

TALKIE = dict(num_frames=12, width=64, height=48, fps=4, rate=24000, seed=9)
"""A 3 s video with a 24 kHz AAC soundtrack (resampled to the extractor's 16 kHz, as vLLM does)."""

WIDTHS = {"audio": 64, "image": 64, "video": 64}
"""Every modality's rows are the text width."""


@pytest.fixture(scope="module")
def eric(qwen2_5_omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    root = tmp_path_factory.mktemp("omni")
    with EricServer(
        qwen2_5_omni_tiny, log_path=root / "eric.log", extra_args=("--dtype", "float32", "--max-audio-channels", "2")
    ) as server:
        yield server


def test_audio_image_and_video_items_are_answered_with_transformers_rows(
    eric: EricServer, qwen2_5_omni_tiny: Path
) -> None:
    card = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
    assert card["modalities"] == ["image", "video", "audio"] and card["placement"] == "media"
    resp = encode_items(eric, request_items())
    assert resp.status_code == 200, resp.text
    assert_answered_with(eric, resp.json()["items"], references(qwen2_5_omni_tiny, omni_rows), WIDTHS)


def test_bad_audio_gets_a_4xx_and_the_server_keeps_serving(eric: EricServer) -> None:
    short = encode_items(eric, [{"modality": "audio", "url": data_url(audio_bytes(100, 16000, 1, "wav"), "audio/wav")}])
    assert short.status_code == 400 and "too short" in short.json()["error"]["message"], short.text
    good = encode_items(
        eric, [{"modality": "audio", "url": data_url(audio_bytes(16000, 16000, 1, "wav", seed=3), "audio/wav")}]
    )
    assert good.status_code == 200 and good.json()["items"][0]["num_tokens"] == 25, good.text


def test_a_video_with_use_audio_in_video_is_answered_with_its_soundtrack(
    eric: EricServer, qwen2_5_omni_tiny: Path
) -> None:
    """The video's rows and, as its `soundtrack`, the rows of the audio vLLM's loader decodes from the same bytes
    (transformers' `get_audio_features` on them); the soundtrack is the item the same bytes give as an audio item."""
    from vllm.multimodal.media.audio import load_audio

    data = video_with_audio_bytes(**TALKIE)
    url = data_url(data, "video/mp4")
    resp = encode_items(
        eric,
        [
            {"id": "talkie", "modality": "video", "url": url, "use_audio_in_video": True},
            {"id": "track", "modality": "audio", "url": url},
        ],
    )
    assert resp.status_code == 200, resp.text
    video, track = resp.json()["items"]
    samples, native = load_audio(io.BytesIO(data), sr=None)
    assert int(native) == TALKIE["rate"] and samples.shape[0] >= TALKIE["rate"] * 3  # the whole track, AAC padding too
    frames, _, _ = decode_video(data, MediaLimits(), load_processor(qwen2_5_omni_tiny).frame_indices)
    refs = omni_rows(qwen2_5_omni_tiny, [(samples, int(native))], videos=[frames])
    sound = video["soundtrack"]
    assert (video["modality"], sound["modality"], sound["id"]) == ("video", "audio", "talkie")
    assert sound["hash"] == track["hash"] and sound["num_tokens"] == track["num_tokens"]
    for answer, ref in ((video, refs["video"][0]), (sound, refs["audio"][0])):
        assert answer["num_tokens"] == answer["shape"][0] == ref.shape[0]
        rows = embedding_rows(eric, answer)
        assert float((rows - ref).abs().max() / ref.abs().max()) <= RTOL, answer["modality"]
    assert "soundtrack" not in track


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (
            {"modality": "video", "url": data_url(video_bytes(seed=6), "video/mp4"), "use_audio_in_video": True},
            "soundtrack (use_audio_in_video): could not decode audio: no audio stream",
        ),
        (
            {"modality": "audio", "url": data_url(audio_bytes(16000, 16000), "audio/wav"), "use_audio_in_video": True},
            "'use_audio_in_video' is for a video",
        ),
        (
            {"modality": "video", "url": data_url(video_bytes(seed=6), "video/mp4"), "use_audio_in_video": "yes"},
            "must be a boolean",
        ),
    ],
)
def test_a_soundtrack_that_cannot_be_had_is_a_400(eric: EricServer, item: dict, message: str) -> None:
    resp = encode_items(eric, [item])
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text
