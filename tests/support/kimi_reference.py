"""Kimi-K2.5 references that share no code with Eric: vLLM 0.32's own multimodal processor for the checkpoint in its
default configuration (the fused CPU processor's bytes, then the tower's device normalization, as vLLM's model applies
it), vLLM's image processor with normalization on the CPU (its float32 table), transformers' processor, and
transformers' model on vLLM's tensors. Nothing here imports eric_epd."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image


@dataclass(frozen=True)
class KimiInputs:
    """What one image becomes."""

    pixel_values: torch.Tensor
    """[patches, 3, 14, 14] float32, as the tower's patch embedding takes them."""
    grid_thw: torch.Tensor
    """[1, 3] int64: (1, patch rows, patch columns)."""
    tokens: int
    """Media tokens the placeholder holds."""


class VllmKimi:
    """vLLM's own processing of an image for the checkpoint, as its engine would run it (no engine started)."""

    def __init__(self, ckpt: Path) -> None:
        from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm
        from vllm.multimodal import MULTIMODAL_REGISTRY

        config = ModelConfig(model=str(ckpt), tokenizer=str(ckpt), dtype="float32", max_model_len=4096)
        assert config.multimodal_config.mm_device_do_normalize  # vLLM's default for this model
        self.processor = MULTIMODAL_REGISTRY.create_processor(config)
        with set_current_vllm_config(VllmConfig(model_config=config)):
            self.norm = build_mm_input_norm(config)  # what KimiK25ForConditionalGeneration hands its patch embedding
        self.prompt = self.processor.info.media_token

    def inputs(self, image: Image.Image) -> KimiInputs:
        """One image through vLLM's multimodal processor as a vision chunk, its bytes normalized by the tower's
        input normalization (float32)."""
        from vllm.multimodal.inputs import VisionChunkImage

        data = self.processor.info.parse_mm_data(
            {"vision_chunk": [VisionChunkImage(type="image", image=image, uuid=None)]}
        )
        out = self.processor(self.prompt, data)
        fields = out["mm_kwargs"]["vision_chunk"][0]
        raw, grid = fields["pixel_values"].data, fields["grid_thws"].data
        assert raw.dtype == torch.uint8, raw.dtype  # the bytes; the tower normalizes them
        with torch.no_grad():
            values = self.norm(raw.flatten(1), torch.float32).view(raw.shape)
        (placeholder,) = out["mm_placeholders"]["vision_chunk"]
        return KimiInputs(values, grid.reshape(1, 3), placeholder.get_num_embeds())


def vllm_table_values(ckpt: Path, image: Image.Image) -> torch.Tensor:
    """vLLM's fused image processor normalizing on the CPU (mm_device_do_normalize off): its float32 table."""
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    processor = KimiK25FusedVisionProcessor.from_pretrained(str(ckpt))
    return processor.preprocess([{"type": "image", "image": image}], return_tensors="pt")["pixel_values"]


def transformers_inputs(ckpt: Path, image: Image.Image) -> KimiInputs:
    """transformers' own Kimi-K2.5 processor (torchvision's bicubic) on one image."""
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(ckpt)
    text = processor.image_token
    out = processor(text=[text], images=[image], return_tensors="pt")
    tokens = int((out["input_ids"] == AutoConfig.from_pretrained(ckpt).image_token_id).sum())
    return KimiInputs(out["pixel_values"], out["image_grid_thw"], tokens)


def transformers_rows(ckpt: Path, inputs: list[KimiInputs], model: Any = None) -> list[torch.Tensor]:
    """transformers' full model (float32), get_image_features on each input alone: its rows."""
    from transformers import AutoModelForImageTextToText

    if model is None:
        model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.get_image_features(i.pixel_values, i.grid_thw).pooler_output[0] for i in inputs]
