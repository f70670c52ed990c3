"""Modality processor interface (PIL image / sampled video frames -> patches + grid) and its pixel kernels:
antialiased bicubic resize of uint8 frames and a per-channel rescale/normalize lookup table."""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ResizeBackend = Literal["torch", "numpy"]


@dataclass(frozen=True)
class ProcessedItem:
    """One image or video ready for the encoder."""

    modality: str  # "image" | "video" | "audio"
    pixel_values: np.ndarray  # float32 (num_patches, C*T*P*P), the layout HF's processor produces
    grid_thw: tuple[int, int, int]
    num_tokens: int  # t*h*w // merge**2
    second_per_grid_ts: float | None = None
    """Seconds between temporal grid steps of a video, for models whose M-RoPE spaces frames by time (Qwen2.5-VL:
    temporal_patch_size / sampled fps, as its HF processor computes); None otherwise."""
    timestamps: tuple[float, ...] | None = None
    """Seconds of each temporal grid step of a video, for models whose prompt states them (Qwen3-VL: vLLM writes
    `<t seconds>` before each step's tokens); None otherwise."""
    feature_frames: int | None = None
    """An audio item's feature frames before the tower (its processor's feature_attention_mask summed): what SGLang's
    prefill expands the audio placeholder from (its `audio_feature_lens`); None for other items."""
    levels: PixelNormalize | None = None
    """When set, `pixel_values` are uint8 levels in the encoder's row layout, and this turns them into its float32
    input (on the worker's device: a quarter of the bytes cross the processes); None: float32 input already."""
    repeat: int = 1
    """With `levels`: how many times the encoder's row holds each of `pixel_values`' channel blocks (an image's one
    frame, which HF's processor copies over the temporal patch: `repeat_rows`, run on the worker's device)."""

    def float_pixels(self) -> np.ndarray:
        """The encoder's float32 input rows: `pixel_values` normalized by `levels` and repeated (HF's processor's
        values), or as they are."""
        if self.levels is None:
            return self.pixel_values
        import torch

        rows = self.levels.rows_(torch.from_numpy(self.pixel_values).to(torch.float32))
        return repeat_rows(rows, self.levels.channels, self.repeat).numpy()


class BaseModalityProcessor(ABC):
    """Turns raw media into encoder inputs; thread-safe (no mutable state after construction)."""

    modalities: tuple[str, ...] = ()

    @abstractmethod
    def process_image(self, image: Image.Image) -> ProcessedItem:
        """One PIL image (any mode; converted to RGB)."""

    @abstractmethod
    def process_video(
        self, frames: np.ndarray, sampled_fps: float = 2.0, seconds: Sequence[float] | None = None
    ) -> ProcessedItem:
        """Already-sampled frames, uint8 (T, H, W, 3) RGB, taken at `sampled_fps` frames per second (2.0, HF's
        default for a video without metadata); `seconds`: each frame's time in the source, when known."""

    def process_audio(self, samples: np.ndarray, sampling_rate: int, hop_padded: bool = True) -> ProcessedItem:
        """Mono float32 audio samples at `sampling_rate` Hz; a processor whose model takes no audio refuses them.
        `hop_padded=False`: a family vLLM pads to whole hops (HFAudioProcessor) is processed as SGLang reads it."""
        raise ValueError(f"this model takes no audio (it takes {', '.join(self.modalities)})")

    def frame_indices(self, total: int, src_fps: float) -> list[int] | None:
        """The source frames this model's processor samples from a video of `total` frames at `src_fps`; None:
        Eric's default (vLLM's uniform sampling at --video-fps)."""
        return None

    @abstractmethod
    def fingerprint(self, modality: str) -> bytes:
        """Stable bytes of every setting that changes the output of `modality` (for content hashing)."""

    def process(self, modality: str, data: Image.Image | np.ndarray) -> ProcessedItem:
        """Dispatch on modality."""
        if modality == "image":
            return self.process_image(data)  # type: ignore[arg-type]
        if modality == "video":
            return self.process_video(data)  # type: ignore[arg-type]
        raise ValueError(f"unsupported modality {modality!r}; this processor handles {self.modalities}")


def image_to_rgb_array(image: Image.Image) -> np.ndarray:
    """uint8 (1, H, W, 3) writable array of a PIL image converted to RGB (as HF's convert_to_rgb)."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.array(image, dtype=np.uint8)[None]


def frames_to_rgb_array(frames: np.ndarray) -> np.ndarray:
    """Validate uint8 (T, H, W, 3) frames (grayscale (T, H, W[, 1]) becomes RGB); writable copy if needed."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8:
        raise ValueError(f"video frames must be uint8, got {frames.dtype}")
    if frames.ndim == 3:
        frames = frames[..., None]
    if frames.ndim != 4 or frames.shape[-1] not in (1, 3) or frames.shape[0] == 0:
        raise ValueError(f"video frames must have shape (T>0, H, W, 3), got {frames.shape}")
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    return frames if frames.flags.writeable else frames.copy()


def repeat_rows(rows: torch.Tensor, channels: int, repeat: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n, C*k) rows of `channels` blocks as (n, C*repeat*k) rows, each block repeated `repeat` times in place (HF's
    layout of one frame copied over the temporal patch); written into `out` (n, C*repeat*k) when given."""
    n, width = rows.shape
    if width % channels:
        raise ValueError(f"rows of {width} values do not split into {channels} channels")
    k = width // channels
    blocks = rows.view(n, channels, 1, k).expand(n, channels, repeat, k)
    if out is None:
        return blocks.reshape(n, channels * repeat * k)
    out.view(n, channels, repeat, k).copy_(blocks)
    return out


# ---- resize ------------------------------------------------------------------------------------------


def _keys_cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _int16_bicubic_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Tap indices (out, k), int16-range integer weights (out, k) and their precision in bits, computed
    exactly as PyTorch's CPU uint8 antialiased bicubic kernel (Keys a=-0.5, PIL-style support scaling)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    ksize = math.ceil(support) * 2 + 1
    centers = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    xsize = np.clip(np.minimum((centers + support + 0.5).astype(np.int64), in_size) - xmin, 0, ksize)
    taps = np.arange(ksize)
    w = _keys_cubic((taps[None] + xmin[:, None] - centers[:, None] + 0.5) * invscale)
    w = np.where(taps[None] < xsize[:, None], w, 0.0)
    total = w.sum(1, keepdims=True)
    w = np.where(total != 0, w / np.where(total != 0, total, 1.0), 0.0)
    wmax = float(w.max())
    precision = 0
    while precision < 22 and int(0.5 + wmax * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * (1 << precision)
    wi = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int32)
    keep = wi.any(0)
    idx = np.minimum(xmin[:, None] + taps[None], in_size - 1)
    return idx[:, keep], wi[:, keep], precision


def _resize_axis_numpy(img: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    idx, w, precision = _int16_bicubic_weights(img.shape[axis], out_size)
    src = img.astype(np.int32)
    out_shape = (*img.shape[:axis], out_size, *img.shape[axis + 1 :])
    wshape = [1] * img.ndim
    wshape[axis] = out_size
    acc = np.full(out_shape, 1 << (precision - 1), dtype=np.int32)
    tmp = np.empty(out_shape, dtype=np.int32)
    for k in range(idx.shape[1]):
        np.take(src, idx[:, k], axis=axis, out=tmp)
        tmp *= w[:, k].reshape(wshape)
        acc += tmp
    acc >>= precision
    return np.clip(acc, 0, 255).astype(np.uint8)


def resize_bicubic_uint8(frames: np.ndarray, height: int, width: int, backend: ResizeBackend = "torch") -> np.ndarray:
    """Antialiased bicubic resize of uint8 (T, H, W, C) frames to (T, height, width, C).

    "torch" runs torch.nn.functional.interpolate on the uint8 tensor, the very kernel HF's default
    (torchvision) Qwen2-VL processors call; "numpy" is a pure-numpy port of that kernel's integer arithmetic
    (horizontal pass then vertical, int16 weights), bit-identical to it on x86 CPUs and ~10x slower.
    """
    if frames.shape[1:3] == (height, width):
        return frames
    if backend == "torch":
        import torch
        import torch.nn.functional as F

        t = torch.from_numpy(frames).permute(0, 3, 1, 2)
        out = F.interpolate(t, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        return out.permute(0, 2, 3, 1).numpy()
    if backend != "numpy":
        raise ValueError(f"unknown resize backend {backend!r}")
    if frames.shape[2] != width:
        frames = _resize_axis_numpy(frames, width, 2)
    if frames.shape[1] != height:
        frames = _resize_axis_numpy(frames, height, 1)
    return frames


# ---- rescale / normalize -----------------------------------------------------------------------------


class PixelNormalize:
    """Per-channel rescale/normalize of uint8 levels with HF torchvision's float32 arithmetic, in place on a float32
    torch tensor of levels (channels on dim 1). Bit for bit `normalize_lut`'s table: checked on all 256 levels of
    every channel when built (IEEE float32 subtraction and division round the same on every CPU and GPU)."""

    def __init__(
        self,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> None:
        import torch

        self.settings = (
            do_rescale,
            float(rescale_factor),
            do_normalize,
            tuple(map(float, mean)),
            tuple(map(float, std)),
        )
        """What it was built from (what an encode item's spec carries to the worker)."""
        table = normalize_lut(do_rescale, rescale_factor, do_normalize, mean, std)
        self.channels = channels = table.shape[0]
        self._sub: torch.Tensor | None = None
        self._div: torch.Tensor | None = None
        self._mul: float | None = None
        self._devices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        if do_normalize:
            m, s = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
            if do_rescale:
                inv = np.float32(1.0 / rescale_factor)
                m, s = m * inv, s * inv
            self._sub, self._div = torch.from_numpy(m), torch.from_numpy(s)
        elif do_rescale:
            self._mul = float(np.float32(rescale_factor))  # float32 arithmetic, as the table's
        levels = torch.arange(256, dtype=torch.float32).expand(1, channels, 256).clone()
        if not np.array_equal(self.apply_(levels)[0].numpy().view(np.uint32), table.view(np.uint32)):
            raise RuntimeError("rescale/normalize arithmetic differs from its table on this machine")

    def apply_(self, levels: torch.Tensor) -> torch.Tensor:
        """`levels` (float32 (N, C, ...), values 0..255, any strides, any device) rescaled/normalized in place;
        returns it."""
        per_channel = (1, levels.shape[1]) + (1,) * (levels.dim() - 2)
        if self._sub is not None and self._div is not None:
            sub, div = self._on(levels.device)
            levels.sub_(sub.view(per_channel)).div_(div.view(per_channel))
        elif self._mul is not None:
            levels.mul_(self._mul)
        return levels

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-channel offsets and divisors on `device`, copied there once."""
        assert self._sub is not None and self._div is not None
        if device not in self._devices:
            self._devices[device] = (self._sub.to(device), self._div.to(device))
        return self._devices[device]

    def rows_(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 (n, C*k) rows of levels, each holding C channel blocks (HF's patch layout), normalized in place;
        returns them."""
        n, width = rows.shape
        if width % self.channels:
            raise ValueError(f"rows of {width} values do not split into {self.channels} channels")
        self.apply_(rows.view(n, self.channels, width // self.channels))
        return rows


def normalize_lut(
    do_rescale: bool, rescale_factor: float, do_normalize: bool, mean: tuple[float, ...], std: tuple[float, ...]
) -> np.ndarray:
    """(C, 256) float32 table of the processed value of each uint8 level per channel, with HF torchvision's
    float32 arithmetic: fused (v - mean/rf) / (std/rf) when both rescaling and normalizing."""
    levels = np.arange(256, dtype=np.float32)[None, :]
    m = np.asarray(mean, dtype=np.float32)[:, None]
    s = np.asarray(std, dtype=np.float32)[:, None]
    channels = len(mean) if do_normalize else 3
    if do_normalize:
        if do_rescale:
            inv = np.float32(1.0 / rescale_factor)
            m, s = m * inv, s * inv
        return ((levels - m) / s).astype(np.float32)
    if do_rescale:
        return np.repeat(levels * np.float32(rescale_factor), channels, axis=0)
    return np.repeat(levels, channels, axis=0)
