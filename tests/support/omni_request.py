"""One Eric request of an Omni thinker's three modalities (clips of odd lengths, rates and channel counts, an image,
a video), transformers' rows for what Eric decodes of it, and the check of Eric's answer against them; shared by the
Qwen2.5-Omni and Qwen3-Omni server tests."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import torch

from eric_epd.eric.decode import decode_video
from eric_epd.media.limits import MediaLimits
from eric_epd.models.registry import load_processor
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import AUDIO_FORMATS, audio_bytes, data_url, image_bytes, random_image, video_bytes
from tests.support.helpers_servers import embedding_rows

RTOL = 1e-5
"""Worst relative error against transformers in float32: the same modules on the same inputs."""
CLIPS = (("wav", 3 * 16000 + 7, 16000, 1), ("flac", 2 * 44100 + 5, 44100, 2))
"""(format, frames, rate, channels) of the clips the request carries."""
IMAGE = (200, 150, 7)
VIDEO = dict(num_frames=8, width=64, height=48, fps=4, seed=5)


def request_items() -> list[dict]:
    """The request's items: the clips, the image, the video, each with an id."""
    items = [
        {
            "id": fmt,
            "modality": "audio",
            "url": data_url(audio_bytes(frames, rate, channels, fmt), AUDIO_FORMATS[fmt][2]),
        }
        for fmt, frames, rate, channels in CLIPS
    ]
    items.append({"id": "image", "modality": "image", "url": data_url(image_bytes(random_image(*IMAGE)))})
    items.append({"id": "video", "modality": "video", "url": data_url(video_bytes(**VIDEO), "video/mp4")})
    return items


def references(model_dir: Path, rows: Callable[..., dict[str, list[torch.Tensor]]]) -> list[tuple[torch.Tensor, str]]:
    """(rows, modality) per item, in request order: `rows` (a thinker reference) on the clips as vLLM's loader
    decodes them, the image, and the video's frames as Eric decodes and samples them."""
    from vllm.multimodal.media.audio import load_audio

    clips = []
    for fmt, frames, rate, channels in CLIPS:
        samples, native = load_audio(io.BytesIO(audio_bytes(frames, rate, channels, fmt)), sr=None)
        clips.append((samples, int(native)))
    frames, _, _ = decode_video(video_bytes(**VIDEO), MediaLimits(), load_processor(model_dir).frame_indices)
    refs = rows(model_dir, clips, [random_image(*IMAGE)], [frames])
    return [*zip(refs["audio"], ("audio",) * len(CLIPS)), (refs["image"][0], "image"), (refs["video"][0], "video")]


def assert_answered_with(
    eric: EricServer, answers: list[dict], expected: list[tuple[torch.Tensor, str]], widths: dict[str, int]
) -> None:
    """Each answer is its item's modality at that modality's width, and its rows (fetched with its lease) equal the
    reference within RTOL."""
    assert [a["id"] for a in answers] == [item["id"] for item in request_items()]
    for answer, (ref, modality) in zip(answers, expected, strict=True):
        assert answer["modality"] == modality and answer["placement"] == "media"
        assert answer["num_tokens"] == answer["shape"][0] == ref.shape[0]
        assert answer["shape"][1] == widths[modality] == ref.shape[1]
        rows = embedding_rows(eric, answer)
        assert rows.dtype == torch.float32 and rows.shape == ref.shape
        assert float((rows - ref).abs().max() / ref.abs().max()) <= RTOL, answer["id"]
