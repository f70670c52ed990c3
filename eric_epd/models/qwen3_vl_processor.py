"""Qwen3-VL / Qwen3.5 preprocessing: Qwen2-VL's image path with the checkpoint's own settings, and videos resized as
Qwen3VLVideoProcessor resizes them (one pixel budget over all frames), with the timestamps vLLM's prompt needs."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eric_epd.models.processor import ProcessedItem, ResizeBackend
from eric_epd.models.qwen2_vl_processor import Qwen2VLModalityProcessor


def smart_resize_video(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target (h, w) of every frame: multiples of `factor`, the whole clip's area (frames rounded to the temporal
    patch) within [min_pixels, max_pixels], aspect ratio kept (as transformers' Qwen3-VL video smart_resize)."""
    if num_frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_timestamps(seconds: Sequence[float], temporal: int) -> tuple[float, ...]:
    """Seconds of each temporal patch as vLLM's Qwen3-VL processor writes them into the prompt: the mean source
    time of the patch's first and last frame (the last frame repeats to fill a patch)."""
    t = list(seconds)
    if not t:
        raise ValueError("a video needs frames")
    t += [t[-1]] * (-len(t) % temporal)
    return tuple((t[k] + t[k + temporal - 1]) / 2 for k in range(0, len(t), temporal))


def sampled_frames(total: int, src_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """Qwen3VLVideoProcessor's sampling (which vLLM applies to a video it loaded whole): int(duration * fps)
    frames, within [min_frames, max_frames] and at most all of them, spread evenly from the first to the last."""
    n = min(max(int(total / src_fps * fps), min_frames), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


class Qwen3VLModalityProcessor(Qwen2VLModalityProcessor):
    """Qwen3-VL images (Qwen2-VL's processing, patch 16, the checkpoint's mean/std) and videos (the frames Eric
    sampled, resized under one budget for the clip; each temporal patch's timestamp travels with the item)."""

    name = "qwen3_vl"

    def target_size(self, modality: str, height: int, width: int, num_frames: int = 1) -> tuple[int, int]:
        """(h, w) of the frames: images as in Qwen2-VL, videos by `smart_resize_video` under the per-frame cap."""
        s = self.settings[modality]
        if modality != "video" or not s.do_resize:
            return super().target_size(modality, height, width, num_frames)
        max_pixels = s.max_pixels
        if s.cap_pixels_per_frame:
            per_frame = max(
                min(s.max_video_tokens * s.factor * s.factor, s.max_pixels // num_frames), int(s.min_pixels * 1.05)
            )
            max_pixels = per_frame * num_frames
        return smart_resize_video(num_frames, height, width, s.temporal_patch_size, s.factor, s.min_pixels, max_pixels)

    def __init__(self, model_dir: str | Path, resize_backend: ResizeBackend = "torch") -> None:
        super().__init__(model_dir, resize_backend)
        path = Path(model_dir) / "video_preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        self.sampling = (float(cfg.get("fps", 2.0)), int(cfg.get("min_frames", 4)), int(cfg.get("max_frames", 768)))
        """(fps, min_frames, max_frames) of the checkpoint's video processor."""

    def frame_indices(self, total: int, src_fps: float) -> list[int] | None:
        """The source frames the checkpoint's video processor samples (its fps, min and max frames)."""
        return sampled_frames(total, src_fps, *self.sampling)

    def process_video(
        self, frames: np.ndarray, sampled_fps: float = 2.0, seconds: Sequence[float] | None = None
    ) -> ProcessedItem:
        """Qwen2-VL's video item, plus each temporal patch's timestamp from the frames' times in the source."""
        item = super().process_video(frames, sampled_fps, seconds)
        if seconds is None:  # frames taken evenly at sampled_fps from the start
            seconds = [i / sampled_fps for i in range(frames.shape[0])]
        temporal = self.settings["video"].temporal_patch_size
        return dataclasses.replace(item, timestamps=frame_timestamps(seconds, temporal))
