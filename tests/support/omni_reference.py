"""Reference rows for Qwen2.5-Omni and Qwen3-Omni tests: transformers' full thinker (language model included) on its
processor's output for one item at a time, through `get_audio_features`,
`get_image_features` and `get_video_features`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


def sample_clips(clips: tuple[tuple[int, int], ...], seed: int) -> list[tuple[np.ndarray, int]]:
    """Mono test clips, one per (samples, rate), seeded from `seed` up: (samples, rate) as the references take them."""
    from eric_epd.testing.media import audio_samples

    return [(audio_samples(n, rate, seed=seed + i)[:, 0], rate) for i, (n, rate) in enumerate(clips)]


def sample_images(sizes: tuple[tuple[int, int], ...], seed: int) -> list[Image.Image]:
    """Random test images, one per (width, height), seeded from `seed` up."""
    from eric_epd.testing.media import random_image

    return [random_image(w, h, seed=seed + i) for i, (w, h) in enumerate(sizes)]


AUDIO_TEXT = "<|audio_bos|><|AUDIO|><|audio_eos|>"
IMAGE_TEXT = "<|vision_bos|><|IMAGE|><|vision_eos|>"
VIDEO_TEXT = "<|vision_bos|><|VIDEO|><|vision_eos|>"
"""The chat template's text for one item of each modality."""


def omni_rows(
    model_dir: Path,
    clips: list[tuple[np.ndarray, int]] = (),
    images: list[Image.Image] = (),
    videos: list[np.ndarray] = (),
) -> dict[str, list[torch.Tensor]]:
    """Per modality, per item (clips: mono samples and their rate, resampled to 16 kHz as vLLM does; images; videos:
    uint8 [T, H, W, 3] frames): the thinker's features for it, checked to be as many as the processor's tokens."""
    from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration

    from eric_epd.media.resample import resample

    hf = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[str, list[torch.Tensor]] = {"audio": [], "image": [], "video": []}
    with torch.no_grad():
        for samples, rate in clips:
            inputs = hf(text=[AUDIO_TEXT], audio=[resample(samples, rate, 16000)], return_tensors="pt")
            features = model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"])
            out["audio"].append(_checked(features.last_hidden_state, inputs, model.config.audio_token_id))
        for image in images:
            inputs = hf(text=[IMAGE_TEXT], images=[image], return_tensors="pt")
            (rows,) = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            out["image"].append(_checked(rows, inputs, model.config.image_token_id))
        for frames in videos:
            inputs = hf(text=[VIDEO_TEXT], videos=[frames], return_tensors="pt")
            (rows,) = model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
            out["video"].append(_checked(rows, inputs, model.config.video_token_id))
    return out


def _checked(rows: torch.Tensor, inputs: dict, token_id: int) -> torch.Tensor:
    """`rows`, after checking the processor gave as many of the item's tokens (what the forward scatters them into)."""
    assert rows.shape[0] == int((inputs["input_ids"] == token_id).sum())
    return rows


QWEN3_TEXT = {
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}
"""Qwen3-Omni's chat-template text for one item of each modality."""


def qwen3_omni_rows(
    model_dir: Path,
    clips: list[tuple[np.ndarray, int]] = (),
    images: list[Image.Image] = (),
    videos: list[np.ndarray] = (),
) -> dict[str, list[torch.Tensor]]:
    """omni_rows for Qwen3-Omni's thinker, as vLLM 0.32 feeds it: every clip resampled to 16 kHz and zero-padded to a
    whole number of 160-sample hops before the processor; image and video rows are [merged | DeepStack levels]."""
    from transformers import AutoProcessor, Qwen3OmniMoeThinkerForConditionalGeneration

    from eric_epd.media.resample import resample

    hf = AutoProcessor.from_pretrained(model_dir)
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[str, list[torch.Tensor]] = {"audio": [], "image": [], "video": []}
    with torch.no_grad():
        for samples, rate in clips:
            wave = resample(samples, rate, 16000)
            wave = np.pad(wave, (0, -len(wave) % 160))
            inputs = hf(text=[QWEN3_TEXT["audio"]], audio=[wave], return_tensors="pt")
            assert int(inputs["feature_attention_mask"].sum()) == len(wave) // 160
            features = model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"])
            out["audio"].append(_checked(features.last_hidden_state, inputs, model.config.audio_token_id))
        for image in images:
            inputs = hf(text=[QWEN3_TEXT["image"]], images=[image], return_tensors="pt")
            feats = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            out["image"].append(_checked(_stacked(feats), inputs, model.config.image_token_id))
        for frames in videos:
            inputs = hf(text=[QWEN3_TEXT["video"]], videos=[frames], return_tensors="pt")
            feats = model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
            out["video"].append(_checked(_stacked(feats), inputs, model.config.video_token_id))
    return out


def qwen3_omni_audio_batches(
    model_dir: Path, clips: list[tuple[np.ndarray, int]], hop_padded: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per clip, Qwen3-Omni's thinker's `get_audio_features` rows with the clip alone, and with all `clips` in one
    call (each clip's log-mels from the processor alone, padded together to the longest and masked: every chunk is
    then padded to the batch's longest, which reaches a sub-second clip's rows, in transformers and vLLM alike).
    Clips are resampled to 16 kHz and, if `hop_padded`, zero-padded to whole 160-sample hops as vLLM feeds them
    (else left as SGLang feeds them)."""
    from transformers import AutoProcessor, Qwen3OmniMoeThinkerForConditionalGeneration

    from eric_epd.media.resample import resample

    hf = AutoProcessor.from_pretrained(model_dir)
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    waves = [resample(samples, rate, 16000) for samples, rate in clips]
    waves = [np.pad(wave, (0, -len(wave) % 160)) if hop_padded else wave for wave in waves]
    inputs = [hf(text=[QWEN3_TEXT["audio"]], audio=[wave], return_tensors="pt") for wave in waves]
    lengths = torch.cat([i["feature_attention_mask"].sum(-1) for i in inputs])
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    features = torch.zeros(len(waves), inputs[0]["input_features"].shape[1], mask.shape[1])
    for row, (item, length) in enumerate(zip(inputs, lengths.tolist())):
        features[row, :, :length] = item["input_features"][0, :, :length]
    with torch.no_grad():
        alone = [
            _checked(
                model.get_audio_features(i["input_features"], i["feature_attention_mask"]).last_hidden_state,
                i,
                model.config.audio_token_id,
            )
            for i in inputs
        ]
        batched = model.get_audio_features(features, mask.to(torch.long)).last_hidden_state
    return alone, list(batched.split([rows.shape[0] for rows in alone]))


def _stacked(features) -> torch.Tensor:
    """One item's merged rows with its DeepStack levels beside them, as vLLM's Qwen3-Omni tower returns them."""
    (rows,) = features.pooler_output
    return torch.cat([rows, *(level[0] for level in features.deepstack_features)], dim=-1)
