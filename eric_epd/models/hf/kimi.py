"""Kimi-K2.5's images as vLLM 0.32 preprocesses them, computed by Eric bit for bit.

vLLM does not run transformers' `Kimi_K25ImageProcessor` for this family. Its `KimiK25FusedVisionProcessor` (used
whenever numba imports, a vLLM dependency; without numba vLLM falls back to the checkpoint's remote-code processor,
which the fused one was written from, not checked here) takes the released checkpoint's NaViT size, then:

1. scales the 8-bit RGB image to that size with PIL's bicubic filter (PIL widens the kernel on a downscale);
2. pads it with zero bytes at the bottom and right to whole merged patches (28 pixels);
3. cuts [H, W, 3] into patches [grid_h * grid_w, 3, 14, 14] of bytes, row by row;
4. with `mm_device_do_normalize` (on by default for this model) the tower normalizes them on its device,
   byte * (1/255 / std) + (-mean / std) in float32 (`FusedMMInputNorm`); with it off, the processor maps each byte
   through a float32 table, (v / 255 - mean) * (1 / std), an ulp apart at most.

transformers' port scales with torchvision's bicubic on a uint8 tensor instead (a few 8-bit levels from PIL's on every
image it scales down: the tiny model's rows up to 6e-3 apart) and normalizes as (v - 255 mean) / (255 std), an ulp
apart again. Eric's rows feed vLLM's placeholders, so Eric computes what vLLM's tower sees by default; the checkpoint's
transformers settings give the limits and statistics (kimi_settings_agree refuses a checkpoint whose `media_proc_cfg`,
which vLLM reads, says otherwise)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

RESAMPLE = Image.Resampling.BICUBIC
"""vLLM's filter (KimiK25FusedVisionProcessor.resize_image), the released remote-code processor's too."""
RESCALE = 1 / 255
"""vLLM's rescale factor for this model (`media_proc_cfg` names none; both of vLLM's normalizations use 1/255)."""


def kimi_size(height: int, width: int, image_processor: Any) -> tuple[int, int]:
    """(height, width) the image is scaled to: within the patch limit and the per-side limit, never up (transformers'
    `navit_resize` is the same arithmetic as vLLM's `navit_resize_image`)."""
    from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

    size, _ = navit_resize(
        height,
        width,
        image_processor.patch_size,
        image_processor.merge_size,
        image_processor.max_patches,
        image_processor.size["max_height"],
    )
    return size


def device_normalized(patches: torch.Tensor, mean: Any, std: Any) -> torch.Tensor:
    """uint8 patches [N, 3, p, p] as float32 in the arithmetic of vLLM's device normalization (FusedMMInputNorm's
    forward_native): weight (1/255) / std and bias -mean / std in float32, then byte * weight + bias, two roundings."""
    mean_t, std_t = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)
    weight, bias = (RESCALE / std_t).view(1, -1, 1, 1), (-mean_t / std_t).view(1, -1, 1, 1)
    return patches * weight + bias


def padded_bytes(image: Image.Image, image_processor: Any) -> np.ndarray:
    """The RGB image scaled to kimi_size with RESAMPLE and padded with zero bytes, bottom and right, to whole merged
    patches: [H, W, 3] uint8."""
    height, width = kimi_size(image.height, image.width, image_processor)
    scaled = np.asarray(image.resize((width, height), resample=RESAMPLE))  # PIL copies an image already that size
    factor = image_processor.patch_size * image_processor.merge_size
    out = np.zeros((-(-height // factor) * factor, -(-width // factor) * factor, 3), dtype=np.uint8)
    out[:height, :width] = scaled
    return out


def patchify(values: np.ndarray, patch_size: int) -> np.ndarray:
    """[H, W, C] -> [(H / p) * (W / p), C, p, p], patches row by row (vLLM's and transformers' order)."""
    height, width, channels = values.shape
    grid = values.reshape(height // patch_size, patch_size, width // patch_size, patch_size, channels)
    return np.ascontiguousarray(grid.transpose(0, 2, 4, 1, 3).reshape(-1, channels, patch_size, patch_size))


def kimi_tensors(image: Image.Image, image_processor: Any) -> tuple[dict[str, torch.Tensor], int]:
    """An RGB image's `pixel_values` [N, 3, 14, 14] (float32) and `image_grid_thw` [1, 3] as vLLM's tower gets them,
    and its rows: merged patches, the media tokens vLLM's placeholder holds."""
    patch, merge = image_processor.patch_size, image_processor.merge_size
    data = padded_bytes(image, image_processor)
    grid_h, grid_w = data.shape[0] // patch, data.shape[1] // patch
    patches = torch.from_numpy(patchify(data, patch))
    tensors = {
        "pixel_values": device_normalized(patches, image_processor.image_mean, image_processor.image_std),
        "image_grid_thw": torch.tensor([[1, grid_h, grid_w]], dtype=torch.int64),
    }
    return tensors, (grid_h // merge) * (grid_w // merge)


def kimi_settings_agree(image_processor: Any) -> None:
    """A released Kimi-K2.5 checkpoint also carries `media_proc_cfg`, which vLLM's processor reads instead of
    transformers' settings: ValueError unless the two give every image the same size and values."""
    released = getattr(image_processor, "media_proc_cfg", None)
    if released is None:
        return
    ours = {
        "in_patch_limit": image_processor.max_patches,
        "patch_limit_on_one_side": image_processor.size["max_height"],
        "patch_size": image_processor.patch_size,
        "merge_kernel_size": image_processor.merge_size,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "fixed_output_tokens": None,
    }  # vLLM would give every image that many tokens, whatever its grid
    differ = {k: (v, released.get(k)) for k, v in ours.items() if _scalar(released.get(k)) != _scalar(v)}
    if differ:
        raise ValueError(
            "the checkpoint's transformers image-processor settings and its media_proc_cfg (what vLLM "
            f"reads) disagree, so Eric's rows would not be vLLM's: {differ}"
        )


def _scalar(value: Any) -> Any:
    """[2, 2] and 2 alike (merge kernels are written both ways); lists as lists."""
    if isinstance(value, list | tuple):
        return value[0] if len(set(value)) == 1 and len(value) == 2 else list(value)
    return value
