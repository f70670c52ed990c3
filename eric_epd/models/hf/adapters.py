"""Per-family facts of the generic path: how transformers' `get_image_features` output becomes the rows vLLM's model
puts in an item's placeholder positions, and which string stands for an image in the processor's text."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from PIL import Image
from torch import nn

logger = logging.getLogger(__name__)


def pooled_rows(model: nn.Module, out: Any) -> torch.Tensor:
    """The default layout: `pooler_output` as 2-D rows, whether it is one tensor per item (a tuple or list: LLaVA-
    OneVision, Mistral 3, GLM-4.1V, Gemma 4, Kimi-K2.5) or one [tiles, tokens, hidden] tensor (Gemma 3, InternVL,
    Idefics3/SmolVLM), concatenated in item order."""
    pooled = out.pooler_output
    parts = list(pooled) if isinstance(pooled, list | tuple) else [pooled]
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])


def kimi_resized(image: Image.Image, image_processor: Any) -> Image.Image:
    """Kimi-K2.5: vLLM preprocesses with its own image processor, which scales an image down with PIL's bicubic
    filter (transformers' with torchvision's, up to a level of 8-bit rounding apart); Eric scales it the same way
    first, to the size transformers' processor then keeps (its `navit_resize` never scales up)."""
    from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

    (height, width), _ = navit_resize(image.height, image.width, image_processor.patch_size,
                                      image_processor.merge_size, image_processor.max_patches,
                                      image_processor.size["max_height"])
    if (height, width) == (image.height, image.width):
        return image
    return image.resize((width, height), resample=Image.Resampling.BICUBIC)


def kimi_settings_agree(image_processor: Any) -> None:
    """A released Kimi-K2.5 checkpoint also carries `media_proc_cfg`, which vLLM's processor reads instead of
    transformers' settings: ValueError unless the two give every image the same size and values."""
    released = getattr(image_processor, "media_proc_cfg", None)
    if released is None:
        return
    ours = {"in_patch_limit": image_processor.max_patches,
            "patch_limit_on_one_side": image_processor.size["max_height"],
            "patch_size": image_processor.patch_size, "merge_kernel_size": image_processor.merge_size,
            "image_mean": list(image_processor.image_mean), "image_std": list(image_processor.image_std)}
    differ = {k: (v, released.get(k)) for k, v in ours.items() if _scalar(released.get(k)) != _scalar(v)}
    if differ:
        raise ValueError("the checkpoint's transformers image-processor settings and its media_proc_cfg (what vLLM "
                         f"reads) disagree, so Eric's rows would not be vLLM's: {differ}")


def _scalar(value: Any) -> Any:
    """[2, 2] and 2 alike (merge kernels are written both ways); lists as lists."""
    if isinstance(value, list | tuple):
        return value[0] if len(set(value)) == 1 and len(value) == 2 else list(value)
    return value


def projected_rows(model: nn.Module, out: Any) -> torch.Tensor:
    """Llama 4: `get_image_features` stops at the vision model (HF's forward applies the projector): project
    every tile's tokens, then tiles in order."""
    hidden = model.multi_modal_projector(out.last_hidden_state)
    return hidden.reshape(-1, hidden.shape[-1])


def deepstack_rows(model: nn.Module, out: Any) -> torch.Tensor:
    """Qwen3-Omni's thinker: each merged token's row with its DeepStack levels beside it, [merged | level 1 | ... |
    level k], items in order: the rows vLLM's qwen3_omni_moe_thinker tower returns and its embed_input_ids splits
    (`pooler_output` is one tensor per item, `deepstack_features` one such tuple per level)."""
    levels = [torch.cat(list(level)) for level in out.deepstack_features]
    return torch.cat([torch.cat(list(out.pooler_output)), *levels], dim=-1)


@dataclass(frozen=True)
class FamilyLayout:
    """One family's layout on the generic path."""

    rows: Callable[[nn.Module, Any], torch.Tensor] = pooled_rows
    """(model, get_image_features output for a batch) -> the batch's rows, items in order."""
    video_rows: Callable[[nn.Module, Any], torch.Tensor] = pooled_rows
    """The same for get_video_features' output (one tensor per item in every family so far but Qwen3-Omni's)."""
    placeholder: str = "image_token"
    """The processor attribute holding the text that stands for one image (the processor expands it)."""
    verified: bool = True
    """Checked against vLLM's model for this family (rows, order, count)."""
    prepare: Callable[[Image.Image, Any], Image.Image] | None = None
    """(image, image processor) -> the image as vLLM's processor would have it before transformers' runs."""
    check: Callable[[Any], None] | None = None
    """(image processor) -> None, or ValueError when the checkpoint's settings cannot give vLLM's rows."""
    video_grid: bool = False
    """A video item's grid_thw is the processor's `video_grid_thw` (SGLang's receiver lays out the family's video
    tokens and M-RoPE from it), not (1, 1, rows); only Qwen3-Omni's so far, so other families' SGLang part headers
    stay as they were (vLLM's processor lays out a generic-path placeholder from the media, needing no grid)."""


LAYOUTS: Mapping[str, FamilyLayout] = MappingProxyType({
    "gemma3": FamilyLayout(placeholder="boi_token"),  # its image_token is the soft token the boi expands into
    "gemma4": FamilyLayout(),
    "internvl": FamilyLayout(),
    "llava_onevision": FamilyLayout(),  # image_newline rows are rows (the placeholder is all image tokens)
    "llama4": FamilyLayout(rows=projected_rows),
    "mistral3": FamilyLayout(),
    "glm4v": FamilyLayout(),
    "glm4v_moe": FamilyLayout(),
    "idefics3": FamilyLayout(),
    "smolvlm": FamilyLayout(),
    "kimi_k25": FamilyLayout(prepare=kimi_resized, check=kimi_settings_agree),
    "qwen2_5_omni": FamilyLayout(),  # the thinker's merged patches, one tensor per image (vLLM's qwen2_5_omni_thinker)
    "qwen3_omni_moe": FamilyLayout(rows=deepstack_rows, video_rows=deepstack_rows,  # vLLM's qwen3_omni_moe_thinker
                                   video_grid=True),  # SGLang's get_rope_index_qwen3_omni
})
"""HF model_type -> layout, for the families whose vLLM model was read; any other takes the default, unverified."""


def layout_for(model_type: str) -> FamilyLayout:
    """The family's layout; the default one (pooled rows, `image_token`) for a family not in LAYOUTS."""
    layout = LAYOUTS.get(model_type)
    if layout is None:
        logger.warning("model_type %r is not among the families whose layout was checked against vLLM (%s): its rows "
                       "are get_image_features' pooler_output as is", model_type, ", ".join(sorted(LAYOUTS)))
        return FamilyLayout(verified=False)
    return layout
