"""Videos as SGLang's own encoder prepares them for the Qwen-VL families (`sglang/srt/multimodal/processors/qwen_vl.py`,
0.5.23): its frame count and a first bilinear resize before the checkpoint's processor, so Eric's rows are SGLang's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

QWEN_VL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_omni_moe"}
)
"""The model types whose videos SGLang 0.5.23 prepares with `preprocess_video` (its QwenVLImageProcessor)."""

FACTOR = 28  # SGLang passes its IMAGE_FACTOR for every family, whatever the patch size
FRAME_FACTOR = 2
MAX_RATIO = 200


def _round(n: float, f: int) -> int:
    return round(n / f) * f


def _ceil(n: float, f: int) -> int:
    return math.ceil(n / f) * f


def _floor(n: float, f: int) -> int:
    return math.floor(n / f) * f


@dataclass(frozen=True)
class SglangVideo:
    """SGLang's defaults, overridable as its `--mm-process-config '{"video": {...}}'` overrides them (the same keys),
    and its VIDEO_MAX_PIXELS environment variable (the total pixel budget)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    nframes: int | None = None
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)

    @classmethod
    def from_config(cls, video: dict[str, Any], total_pixels_env: str | None = None) -> SglangVideo:
        """From the "video" part of SGLang's --mm-process-config (unknown keys refused) and VIDEO_MAX_PIXELS."""
        known = set(cls.__dataclass_fields__)
        if unknown := set(video) - known:
            raise ValueError(f"unknown SGLang video settings {sorted(unknown)}; known: {sorted(known)}")
        if "fps" in video and "nframes" in video:
            raise ValueError("SGLang takes either fps or nframes for videos, not both")
        settings = dict(video)
        if total_pixels_env:
            settings.setdefault("total_pixels", int(float(total_pixels_env)))
        return cls(**settings)

    def fingerprint(self) -> bytes:
        """Every setting, for the content hash of videos prepared this way."""
        return repr(self).encode()

    def frame_indices(self, total: int, src_fps: float) -> list[int]:
        """SGLang's smart_nframes and sampling: floor(duration * fps), within [min_frames, max_frames] and the
        source, floored to an even count; spread with linspace over the source."""
        if self.nframes is not None:
            n = _round(self.nframes, FRAME_FACTOR)
        else:
            lo = _ceil(self.min_frames, FRAME_FACTOR)
            hi = _floor(min(self.max_frames, total), FRAME_FACTOR)
            n = _floor(min(max(total / src_fps * self.fps, lo), hi, total), FRAME_FACTOR)
        if not FRAME_FACTOR <= n <= total:
            raise ValueError(
                f"SGLang samples {n} frames from this video of {total}; it needs {FRAME_FACTOR} to {total}"
            )
        return np.unique(np.linspace(0, total - 1, num=n, dtype=np.int64)).tolist()

    def target_size(self, height: int, width: int, frames: int) -> tuple[int, int]:
        """SGLang's smart_resize with its video pixel budget for `frames` frames."""
        if max(height, width) / min(height, width) > MAX_RATIO:
            raise ValueError(f"absolute aspect ratio must be smaller than {MAX_RATIO}")
        max_pixels = max(min(self.max_pixels, self.total_pixels / frames * FRAME_FACTOR), int(self.min_pixels * 1.05))
        h, w = max(FACTOR, _round(height, FACTOR)), max(FACTOR, _round(width, FACTOR))
        if h * w > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            h, w = _floor(height / beta, FACTOR), _floor(width / beta, FACTOR)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = _ceil(height * beta, FACTOR), _ceil(width * beta, FACTOR)
        return h, w

    def resize(self, frames: np.ndarray) -> np.ndarray:
        """uint8 (T, H, W, 3) frames resized as SGLang resizes them before the processor: torchvision's bilinear
        resize of the uint8 tensor (antialiased, its default) to `target_size`."""
        import torch
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.functional import resize

        h, w = self.target_size(frames.shape[1], frames.shape[2], frames.shape[0])
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        out = resize(video, [h, w], interpolation=InterpolationMode.BILINEAR)
        return out.permute(0, 2, 3, 1).contiguous().numpy()
