"""Every Qwen3-generation family against transformers in float32, every DeepStack level included: through a served
TP-2 Eric, images of odd sizes and a video (Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE; Qwen3-VL has its own tests); in
process at TP 1, a video (all four). Gemma 3 and InternVL (the generic path's processor, Eric's own towers) through a
served TP-2 Eric, images; Qwen2-Audio likewise, audio clips; Qwen2.5-Omni's and Qwen3-Omni's thinkers, audio clips,
an image and a video."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load as load_safetensors

from eric_epd.eric.decode import decode_video
from eric_epd.media.limits import MediaLimits
from eric_epd.models.registry import load_processor
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import AUDIO_FORMATS, audio_bytes, data_url, image_bytes, random_image, video_bytes
from eric_epd.wire.handles import LEASE_HEADER

SIZES = [(120, 90), (33, 200), (57, 57)]


def _rows(out) -> torch.Tensor:
    """transformers' rows: the merged tokens, then each DeepStack level (if the family has them) on the last dim."""
    levels = getattr(out, "deepstack_features", None) or []
    return torch.cat([out.pooler_output[0], *(level[0] for level in levels)], dim=-1)


def _fetched(eric: EricServer, item: dict) -> torch.Tensor:
    resp = httpx.get(item["handle"]["http"], headers=eric.headers | {LEASE_HEADER: item["handle"]["lease"]})
    assert resp.status_code == 200, resp.text
    return load_safetensors(resp.content)["embedding"]


def _served(model_dir: Path, items: list[dict], log: Path, *args: str) -> tuple[dict, list[dict], list[torch.Tensor]]:
    """One TP-2 Eric on `model_dir` asked to encode `items`: its card, its answered items and their rows (read over
    HTTP with each item's lease)."""
    with EricServer(model_dir, tp=2, log_path=log, extra_args=args) as eric:
        card = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
        resp = httpx.post(eric.url + "/v1/encode", json={"items": items}, headers=eric.headers, timeout=120)
        assert resp.status_code == 200, resp.text
        answered = resp.json()["items"]
        return card, answered, [_fetched(eric, item) for item in answered]


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_tp2_eric_equals_hf_images_and_video(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir: Path = request.getfixturevalue(f"{family}_tiny")
    images = [image_bytes(random_image(w, h, seed=90 + i)) for i, (w, h) in enumerate(SIZES)]
    video = video_bytes(num_frames=11, width=88, height=56, fps=4, seed=9)
    items = [{"modality": "image", "url": data_url(b)} for b in images]
    items.append({"modality": "video", "url": data_url(video, "video/mp4")})
    _, answered, rows = _served(model_dir, items, tmp_path / "eric.log")

    hf = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    for data, item, mine in zip(images, answered, rows):
        inputs = hf.image_processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            ref = _rows(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]))
        assert item["grid_thw"] == inputs["image_grid_thw"][0].tolist()
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)

    frames, _, _ = decode_video(video, MediaLimits(), load_processor(model_dir).frame_indices)
    inputs = hf.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    with torch.no_grad():
        ref = _rows(model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]))
    assert answered[-1]["grid_thw"] == inputs["video_grid_thw"][0].tolist()
    assert len(answered[-1]["timestamps"]) == answered[-1]["grid_thw"][0]
    torch.testing.assert_close(rows[-1], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_tp1_video_equals_hf(family: str, request: pytest.FixtureRequest) -> None:
    """The same video through Eric's processor and tower in this process (TP 1): transformers' rows, every level."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from eric_epd.models.registry import load_encoder

    model_dir: Path = request.getfixturevalue(f"{family}_tiny")
    processor, encoder = load_processor(model_dir), load_encoder(model_dir, torch.float32, "cpu")
    frames, fps, seconds = decode_video(
        video_bytes(num_frames=9, width=72, height=56, fps=4, seed=10), MediaLimits(), processor.frame_indices
    )
    item = processor.process_video(frames, fps, seconds)
    mine = encoder(torch.from_numpy(item.float_pixels()), torch.tensor([list(item.grid_thw)]))
    inputs = AutoProcessor.from_pretrained(model_dir).video_processor(
        videos=[frames], do_sample_frames=False, return_tensors="pt"
    )
    np.testing.assert_array_equal(item.float_pixels(), inputs["pixel_values_videos"].numpy())
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = _rows(model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]))
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


def test_tp2_eric_gemma3_equals_hf(tmp_path: Path) -> None:
    """Gemma 3 at --tp 2: each of three images (wide, tall, square) is answered, placed as media, with as many rows
    as transformers' processor gives its image tokens, equal to transformers' get_image_features on that processor's
    pixels (float32, worst relative error 1e-5), read over HTTP with the item's lease."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from eric_epd.checkpoints.families import ensure_family_checkpoint

    model_dir = ensure_family_checkpoint("gemma3")
    images = [random_image(w, h, seed=120 + i) for i, (w, h) in enumerate(SIZES)]
    items = [{"modality": "image", "url": data_url(image_bytes(image))} for image in images]
    card, answered, rows = _served(model_dir, items, tmp_path / "eric.log", "--dtype", "float32")
    assert card["tp_size"] == 2 and card["placement"] == "media" and card["modalities"] == ["image"]

    hf = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    for image, item, mine in zip(images, answered, rows, strict=True):
        inputs = hf(text=[hf.boi_token], images=[image], return_tensors="pt")
        with torch.no_grad():
            ref = model.get_image_features(inputs["pixel_values"]).pooler_output.flatten(0, 1)
        assert item["placement"] == "media"
        assert item["num_tokens"] == mine.shape[0] == int((inputs["input_ids"] == model.config.image_token_id).sum())
        assert mine.shape == ref.shape and mine.dtype == torch.float32
        assert float((mine - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_tp2_eric_internvl_equals_hf(tmp_path: Path) -> None:
    """InternVL at --tp 2: each of three images (wide, tall, square: 7, 7 and 1 crops) and a 40-frame video (32
    frames, one tile each) is answered, placed as media, with as many rows as transformers' processor gives its image
    tokens, equal to transformers' get_image_features on that processor's pixels (float32, worst relative error
    1e-5), read over HTTP with the item's lease."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from eric_epd.checkpoints.families import ensure_family_checkpoint

    model_dir = ensure_family_checkpoint("internvl")
    images = [random_image(w, h, seed=130 + i) for i, (w, h) in enumerate(SIZES)]
    video = video_bytes(40, 64, 48, fps=8, seed=131)
    items = [{"modality": "image", "url": data_url(image_bytes(image))} for image in images]
    items.append({"modality": "video", "url": data_url(video, "video/mp4")})
    card, answered, rows = _served(model_dir, items, tmp_path / "eric.log", "--dtype", "float32")
    assert card["tp_size"] == 2 and card["placement"] == "media" and card["modalities"] == ["image", "video"]

    hf = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    frames = decode_video(video, MediaLimits(), load_processor(model_dir).frame_indices)[0]
    crops = []
    for image, item, mine in zip([*images, frames], answered, rows, strict=True):
        media = {"videos": [image]} if image is frames else {"images": [image]}
        inputs = hf(text=[hf.video_token if image is frames else hf.image_token], return_tensors="pt", **media)
        with torch.no_grad():
            ref = model.get_image_features(inputs["pixel_values"]).pooler_output.flatten(0, 1)
        crops.append(int(inputs["pixel_values"].shape[0]))
        assert item["placement"] == "media"
        assert item["num_tokens"] == mine.shape[0] == int((inputs["input_ids"] == model.config.image_token_id).sum())
        assert mine.shape == ref.shape and mine.dtype == torch.float32
        assert float((mine - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert len(set(crops)) > 1, crops  # items of different crop counts


def test_tp2_eric_qwen2_audio_equals_hf(qwen2_audio_tiny: Path, tmp_path: Path) -> None:
    """Qwen2-Audio at --tp 2: three clips (wav, stereo flac at 44.1 kHz, ogg at 8 kHz) are answered, placed as media,
    with as many rows as transformers' processor gives their audio tokens, equal to transformers' full model's audio
    features on the samples vLLM's loader gives (float32, worst relative error 1e-5), read over HTTP with each item's
    lease."""
    from vllm.multimodal.media.audio import load_audio

    from tests.support.audio_reference import transformers_audio_rows

    clips = [("wav", 3 * 16000 + 7, 16000, 1), ("flac", 2 * 44100 + 5, 44100, 2), ("ogg", 5 * 8000 + 3, 8000, 1)]
    encoded = [
        audio_bytes(frames, rate, channels, fmt, seed=140 + i) for i, (fmt, frames, rate, channels) in enumerate(clips)
    ]
    items = [
        {"modality": "audio", "url": data_url(data, AUDIO_FORMATS[fmt][2])} for data, (fmt, *_) in zip(encoded, clips)
    ]
    card, answered, rows = _served(
        qwen2_audio_tiny, items, tmp_path / "eric.log", "--dtype", "float32", "--max-audio-channels", "2"
    )
    assert card["tp_size"] == 2 and card["placement"] == "media" and card["modalities"] == ["audio"]
    decoded = [load_audio(io.BytesIO(data), sr=None) for data in encoded]
    refs = transformers_audio_rows(qwen2_audio_tiny, [(samples, int(rate)) for samples, rate in decoded])
    for item, mine, ref in zip(answered, rows, refs, strict=True):
        assert item["placement"] == "media" and item["num_tokens"] == mine.shape[0]
        assert mine.shape == ref.shape and mine.dtype == torch.float32
        assert float((mine - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_tp2_eric_qwen2_5_omni_equals_hf(qwen2_5_omni_tiny: Path, tmp_path: Path) -> None:
    """Qwen2.5-Omni's thinker at --tp 2: two clips (wav at 16 kHz, stereo flac at 44.1 kHz), an image and a video in
    one request are answered, placed as media, with as many rows as transformers' processor gives their tokens,
    equal to the full thinker's get_audio_features / get_image_features / get_video_features on the samples vLLM's
    loader gives, the image and the frames Eric samples (float32, worst relative error 1e-5), read over HTTP with
    each item's lease."""
    from vllm.multimodal.media.audio import load_audio

    from tests.support.omni_reference import omni_rows

    clips = [("wav", 3 * 16000 + 7, 16000, 1), ("flac", 2 * 44100 + 5, 44100, 2)]
    encoded = [
        audio_bytes(frames, rate, channels, fmt, seed=150 + i) for i, (fmt, frames, rate, channels) in enumerate(clips)
    ]
    image = random_image(200, 150, seed=151)
    video = video_bytes(num_frames=8, width=64, height=48, fps=4, seed=152)
    items = [
        {"modality": "audio", "url": data_url(data, AUDIO_FORMATS[fmt][2])} for data, (fmt, *_) in zip(encoded, clips)
    ]
    items += [
        {"modality": "image", "url": data_url(image_bytes(image))},
        {"modality": "video", "url": data_url(video, "video/mp4")},
    ]
    card, answered, rows = _served(
        qwen2_5_omni_tiny, items, tmp_path / "eric.log", "--dtype", "float32", "--max-audio-channels", "2"
    )
    assert card["tp_size"] == 2 and card["placement"] == "media"
    assert card["modalities"] == ["image", "video", "audio"]
    decoded = [load_audio(io.BytesIO(data), sr=None) for data in encoded]
    frames = decode_video(video, MediaLimits(), load_processor(qwen2_5_omni_tiny).frame_indices)[0]
    refs = omni_rows(qwen2_5_omni_tiny, [(samples, int(rate)) for samples, rate in decoded], [image], [frames])
    expected = [*refs["audio"], *refs["image"], *refs["video"]]
    for item, mine, ref in zip(answered, rows, expected, strict=True):
        assert item["placement"] == "media" and item["num_tokens"] == mine.shape[0]
        assert mine.shape == ref.shape and mine.dtype == torch.float32
        assert float((mine - ref).abs().max() / ref.abs().max()) <= 1e-5, item["modality"]


def test_tp2_eric_qwen3_omni_equals_hf(qwen3_omni_tiny: Path, tmp_path: Path) -> None:
    """Qwen3-Omni's thinker at --tp 2 (Eric's own towers, models/qwen3_omni.py): two clips (wav at 16 kHz, stereo flac
    at 44.1 kHz), an image and a video in one request (tests/support/omni_request.py) are answered, placed as media,
    each at its modality's width (image and video rows with their two DeepStack levels beside them), with as many rows
    as transformers' processor gives their tokens, equal to the thinker's get_audio_features / get_image_features /
    get_video_features on the hop-padded samples vLLM's loader gives, the image and the frames Eric samples (float32,
    worst relative error 1e-5), read over HTTP with each item's lease."""
    from tests.support.helpers_servers import encode_items
    from tests.support.omni_reference import qwen3_omni_rows
    from tests.support.omni_request import assert_answered_with, references, request_items

    with EricServer(
        qwen3_omni_tiny,
        tp=2,
        log_path=tmp_path / "eric.log",
        extra_args=("--dtype", "float32", "--max-audio-channels", "2"),
    ) as eric:
        card = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
        assert card["tp_size"] == 2 and card["placement"] == "media"
        assert card["modalities"] == ["image", "video", "audio"]
        resp = encode_items(eric, request_items())
        assert resp.status_code == 200, resp.text
        assert_answered_with(
            eric,
            resp.json()["items"],
            references(qwen3_omni_tiny, qwen3_omni_rows),
            {"audio": 64, "image": 192, "video": 192},
        )
