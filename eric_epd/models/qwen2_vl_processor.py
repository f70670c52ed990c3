"""Qwen2-VL / Qwen2.5-VL image and video preprocessing (smart_resize, bicubic resize, normalize, patchify) in
numpy, reading the checkpoint's preprocessor_config.json / video_preprocessor_config.json with plain json."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from eric_epd.models.processor import (
    BaseModalityProcessor,
    PixelNormalize,
    ProcessedItem,
    ResizeBackend,
    frames_to_rgb_array,
    image_to_rgb_array,
    resize_bicubic_uint8,
)

logger = logging.getLogger(__name__)

FINGERPRINT_VERSION = 1  # bump when the output for the same settings changes
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the only resample the Qwen2-VL processors use
# Class defaults of transformers' Qwen2VLImageProcessor / Qwen2VLVideoProcessor (shortest/longest edge).
IMAGE_DEFAULT_PIXELS = (56 * 56, 28 * 28 * 1280)
VIDEO_DEFAULT_PIXELS = (128 * 28 * 28, 28 * 28 * 768)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (h, w): multiples of `factor`, area in [min_pixels, max_pixels], aspect ratio kept (as HF)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VisionPreprocessSettings:
    """Every setting of one modality's preprocessing that changes its output."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    resample: int
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    @classmethod
    def from_json(cls, d: dict[str, Any], default_pixels: tuple[int, int]) -> VisionPreprocessSettings:
        """Resolve like HF's __init__: min_pixels/max_pixels override size's shortest/longest edge."""
        size = dict(d.get("size") or {})
        lo = d.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", default_pixels[0])))
        hi = d.get("max_pixels", size.get("longest_edge", size.get("max_pixels", default_pixels[1])))
        resample = int(d.get("resample", BICUBIC))
        if resample != BICUBIC:
            raise ValueError(f"only bicubic resampling (3) is supported, config asks for {resample}")
        return cls(
            min_pixels=int(lo),
            max_pixels=int(hi),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            image_mean=tuple(float(x) for x in d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(x) for x in d.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_resize=bool(d.get("do_resize", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            resample=resample,
            cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(d.get("max_video_tokens", 128000)),
        )

    @property
    def factor(self) -> int:
        """Pixels per side of one merged token (patch size times merge size)."""
        return self.patch_size * self.merge_size


def patchify(frames: np.ndarray, patch: int, temporal: int, merge: int) -> tuple[np.ndarray, int]:
    """uint8 (T, h, w, C) frames as uint8 rows in HF's patch layout (t, h/m, w/m, m, m | C, tp, p, p), padding T to a
    multiple of `temporal` by repeating the last frame. Returns (levels uint8 (t*gh*gw, C*tp*p*p), grid_t);
    PixelNormalize.rows turns them into HF's float32 pixel_values. One image: `image_rows`."""
    n_frames, h, w, c = frames.shape
    gh, gw = _grid(h, w, patch, merge)
    import torch

    if pad := -n_frames % temporal:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    grid_t = frames.shape[0] // temporal
    levels = torch.from_numpy(frames).view(grid_t, temporal, gh // merge, merge, patch, gw // merge, merge, patch, c)
    levels = levels.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)  # (t, gh/m, gw/m, m, m, C, tp, p, p)
    return levels.reshape(grid_t * gh * gw, c * temporal * patch * patch).numpy(), grid_t


def image_rows(frame: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """One uint8 (h, w, C) frame as rows of one frame's patches (gh/m, gw/m, m, m | C, p, p): patchify's rows of a
    one-frame item without HF's copy of the frame over the temporal patch, which the worker makes on its device
    (ProcessedItem.repeat), so half the bytes are gathered here and cross the processes."""
    h, w, c = frame.shape
    gh, gw = _grid(h, w, patch, merge)
    patches = frame.reshape(gh // merge, merge, patch, gw // merge, merge, patch, c).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(patches).reshape(gh * gw, c * patch * patch)


def _grid(h: int, w: int, patch: int, merge: int) -> tuple[int, int]:
    """Patches per column and row of an h x w frame; ValueError unless whole merge windows tile it."""
    gh, gw = h // patch, w // patch
    if h % patch or w % patch or gh % merge or gw % merge:
        raise ValueError(f"frame size {h}x{w} is not a multiple of patch*merge = {patch * merge}")
    return gh, gw


class Qwen2VLModalityProcessor(BaseModalityProcessor):
    """Images and videos for Qwen2-VL and Qwen2.5-VL; output equals HF's AutoProcessor for the checkpoint."""

    modalities = ("image", "video")
    name = "qwen2_vl"
    """Names the pixel pipeline in the content-hash fingerprint."""

    def __init__(self, model_dir: str | Path, resize_backend: ResizeBackend = "torch") -> None:
        model_dir = Path(model_dir)
        image_path = model_dir / "preprocessor_config.json"
        if not image_path.exists():
            raise FileNotFoundError(f"{image_path} not found: not a Qwen2-VL checkpoint directory?")
        image_cfg = json.loads(image_path.read_text())
        video_path = model_dir / "video_preprocessor_config.json"
        video_cfg = json.loads(video_path.read_text()) if video_path.exists() else image_cfg
        self.settings = {
            "image": VisionPreprocessSettings.from_json(image_cfg, IMAGE_DEFAULT_PIXELS),
            "video": VisionPreprocessSettings.from_json(video_cfg, VIDEO_DEFAULT_PIXELS),
        }
        self._normalize = {
            m: PixelNormalize(s.do_rescale, s.rescale_factor, s.do_normalize, s.image_mean, s.image_std)
            for m, s in self.settings.items()
        }
        if resize_backend not in ("torch", "numpy"):
            raise ValueError(f"unknown resize backend {resize_backend!r}")
        self.resize_backend: ResizeBackend = resize_backend
        self._fingerprints = {
            m: json.dumps(
                {"processor": self.name, "version": FINGERPRINT_VERSION, "modality": m, **asdict(s)}, sort_keys=True
            ).encode()
            for m, s in self.settings.items()
        }
        logger.debug("Qwen2-VL processor from %s: %s", model_dir, self.settings)

    def fingerprint(self, modality: str) -> bytes:
        """The settings of `modality` as sorted JSON bytes, with the processor's name and version."""
        if modality not in self._fingerprints:
            raise ValueError(f"unsupported modality {modality!r}")
        return self._fingerprints[modality]

    def target_size(self, modality: str, height: int, width: int, num_frames: int = 1) -> tuple[int, int]:
        """(h, w) the frames of an item are resized to."""
        s = self.settings[modality]
        if not s.do_resize:
            return height, width
        max_pixels = s.max_pixels
        if modality == "video" and s.cap_pixels_per_frame:
            total = int(s.max_video_tokens * s.factor * s.factor * 0.9)
            max_pixels = max(min(max_pixels, total * s.temporal_patch_size // num_frames), int(s.min_pixels * 1.05))
        return smart_resize(height, width, s.factor, s.min_pixels, max_pixels)

    def _process(self, modality: str, frames: np.ndarray) -> ProcessedItem:
        s = self.settings[modality]
        h, w = self.target_size(modality, frames.shape[1], frames.shape[2], frames.shape[0])
        frames = resize_bicubic_uint8(frames, h, w, self.resize_backend)
        repeat = s.temporal_patch_size if modality == "image" else 1
        if repeat > 1:  # an image's one frame: the worker copies it over the temporal patch
            levels, grid_t = image_rows(frames[0], s.patch_size, s.merge_size), 1
        else:
            levels, grid_t = patchify(frames, s.patch_size, s.temporal_patch_size, s.merge_size)
        grid = (grid_t, h // s.patch_size, w // s.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // (s.merge_size * s.merge_size)
        return ProcessedItem(modality, levels, grid, tokens, levels=self._normalize[modality], repeat=repeat)

    def process_image(self, image: Image.Image) -> ProcessedItem:
        """One image resized, normalized and patchified with the image settings."""
        return self._process("image", image_to_rgb_array(image))

    def process_video(
        self, frames: np.ndarray, sampled_fps: float = 2.0, seconds: Sequence[float] | None = None
    ) -> ProcessedItem:
        """Sampled frames resized, normalized and patchified with the video settings (timing is not used)."""
        return self._process("video", frames_to_rgb_array(frames))


class Qwen2_5_VLModalityProcessor(Qwen2VLModalityProcessor):  # noqa: N801  (HF naming)
    """Qwen2.5-VL: the same pixels; videos also carry second_per_grid_ts, which its M-RoPE uses."""

    def process_video(
        self, frames: np.ndarray, sampled_fps: float = 2.0, seconds: Sequence[float] | None = None
    ) -> ProcessedItem:
        """Qwen2-VL's video item, plus the seconds each temporal patch spans (`second_per_grid_ts`)."""
        item = super().process_video(frames, sampled_fps, seconds)
        seconds = self.settings["video"].temporal_patch_size / sampled_fps
        return dataclasses.replace(item, second_per_grid_ts=seconds)
