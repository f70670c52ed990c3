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

from eric_epd.models.hf.kimi import kimi_settings_agree, kimi_tensors

logger = logging.getLogger(__name__)


def pooled_rows(model: nn.Module, out: Any) -> torch.Tensor:
    """The default layout: `pooler_output` as 2-D rows, whether it is one tensor per item (a tuple or list: LLaVA-
    OneVision, Mistral 3, GLM-4.1V, Gemma 4, Kimi-K2.5) or one [tiles, tokens, hidden] tensor (Gemma 3, InternVL,
    Idefics3/SmolVLM), concatenated in item order."""
    pooled = out.pooler_output
    parts = list(pooled) if isinstance(pooled, list | tuple) else [pooled]
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])


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
    preprocess: Callable[[Image.Image, Any], tuple[dict[str, torch.Tensor], int]] | None = None
    """(RGB image, image processor) -> its named tensors and rows as vLLM's own processor computes them, in place of
    the checkpoint processor's: a family whose vLLM processor is not transformers' (Kimi-K2.5: models/hf/kimi.py)."""
    check: Callable[[Any], None] | None = None
    """(image processor) -> None, or ValueError when the checkpoint's settings cannot give vLLM's rows."""
    video_grid: bool = False
    """A video item's grid_thw is the processor's `video_grid_thw` (SGLang's receiver lays out the family's video
    tokens and M-RoPE from it), not (1, 1, rows); only Qwen3-Omni's so far, so other families' SGLang part headers
    stay as they were (vLLM's processor lays out a generic-path placeholder from the media, needing no grid)."""


LAYOUTS: Mapping[str, FamilyLayout] = MappingProxyType(
    {
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
        "kimi_k25": FamilyLayout(preprocess=kimi_tensors, check=kimi_settings_agree),
        # the thinker's merged patches, one tensor per image (vLLM's qwen2_5_omni_thinker)
        "qwen2_5_omni": FamilyLayout(),
        "qwen3_omni_moe": FamilyLayout(
            rows=deepstack_rows,
            video_rows=deepstack_rows,  # vLLM's qwen3_omni_moe_thinker
            video_grid=True,
        ),  # SGLang's get_rope_index_qwen3_omni
    }
)
"""HF model_type -> layout, for the families whose vLLM model was read; any other takes the default, unverified."""


def layout_for(model_type: str) -> FamilyLayout:
    """The family's layout; the default one (pooled rows, `image_token`) for a family not in LAYOUTS."""
    layout = LAYOUTS.get(model_type)
    if layout is None:
        logger.warning(
            "model_type %r is not among the families whose layout was checked against vLLM (%s): its rows "
            "are get_image_features' pooler_output as is",
            model_type,
            ", ".join(sorted(LAYOUTS)),
        )
        return FamilyLayout(verified=False)
    return layout
