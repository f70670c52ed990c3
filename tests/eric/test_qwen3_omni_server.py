"""A real Eric (router, engine, worker) on the tiny Qwen3-Omni-MoE checkpoint: one request carrying audio clips (odd
lengths, rates and channel counts, each at least a second), an image and a video is answered with rows of each
modality's own width (DeepStack image and video rows three times the text width, audio rows the text width),
fetched over the transfer path with each item's lease, equal to transformers' thinker's on the samples vLLM's loader
gives (zero-padded to whole hops, as vLLM feeds the model), the decoded image and the frames Eric samples."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from eric_epd.eric.decode import decode_video
from eric_epd.media.limits import MediaLimits
from eric_epd.models.registry import load_processor
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import AUDIO_FORMATS, audio_bytes, data_url, image_bytes, random_image, video_bytes
from tests.support.helpers_servers import embedding_rows, encode_items
from tests.support.omni_reference import qwen3_omni_rows

RTOL = 1e-5
"""Worst relative error against transformers in float32: the same modules on the same inputs."""

CLIPS = (("wav", 3 * 16000 + 7, 16000, 1), ("flac", 2 * 44100 + 5, 44100, 2))
"""(format, frames, rate, channels) of the clips the request carries."""
IMAGE = (200, 150, 7)
VIDEO = dict(num_frames=8, width=64, height=48, fps=4, seed=5)
WIDTHS = {"audio": 64, "image": 192, "video": 192}


@pytest.fixture(scope="module")
def eric(qwen3_omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    root = tmp_path_factory.mktemp("qwen3-omni")
    with EricServer(qwen3_omni_tiny, log_path=root / "eric.log",
                    extra_args=("--dtype", "float32", "--max-audio-channels", "2")) as server:
        yield server


def _references(model_dir: Path) -> dict[str, list[torch.Tensor]]:
    """Transformers' thinker's rows on the clips as vLLM's loader decodes them, the image, and the video's frames as
    Eric decodes and samples them."""
    from vllm.multimodal.media.audio import load_audio

    clips = []
    for fmt, frames, rate, channels in CLIPS:
        samples, native = load_audio(io.BytesIO(audio_bytes(frames, rate, channels, fmt)), sr=None)
        clips.append((samples, int(native)))
    frames, _, _ = decode_video(video_bytes(**VIDEO), MediaLimits(), load_processor(model_dir).frame_indices)
    return qwen3_omni_rows(model_dir, clips, [random_image(*IMAGE)], [frames])


def test_items_are_answered_with_transformers_rows_at_their_modalitys_width(eric: EricServer,
                                                                            qwen3_omni_tiny: Path) -> None:
    card = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
    assert card["modalities"] == ["image", "video", "audio"] and card["placement"] == "media"
    items = [{"id": fmt, "modality": "audio", "url": data_url(audio_bytes(frames, rate, channels, fmt),
                                                               AUDIO_FORMATS[fmt][2])}
             for fmt, frames, rate, channels in CLIPS]
    items.append({"id": "image", "modality": "image", "url": data_url(image_bytes(random_image(*IMAGE)))})
    items.append({"id": "video", "modality": "video", "url": data_url(video_bytes(**VIDEO), "video/mp4")})
    resp = encode_items(eric, items)
    assert resp.status_code == 200, resp.text
    answers = resp.json()["items"]
    refs = _references(qwen3_omni_tiny)
    expected = [*zip(refs["audio"], ("audio",) * len(CLIPS)), (refs["image"][0], "image"), (refs["video"][0], "video")]
    assert [a["id"] for a in answers] == [item["id"] for item in items]
    for answer, (ref, modality) in zip(answers, expected):
        assert answer["modality"] == modality and answer["placement"] == "media"
        assert answer["num_tokens"] == answer["shape"][0] == ref.shape[0]
        assert answer["shape"][1] == WIDTHS[modality] == ref.shape[1]
        rows = embedding_rows(eric, answer)
        assert rows.dtype == torch.float32 and rows.shape == ref.shape
        assert float((rows - ref).abs().max() / ref.abs().max()) <= RTOL, answer["id"]
