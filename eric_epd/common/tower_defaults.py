"""What a hand-written Qwen vision tower takes for a key its checkpoint's vision_config leaves out: the value
transformers' own vision config class of that family gives it (transformers 5.19), never a released model's.

tests/models/test_tower_configs.py checks every table here against transformers' classes. Imports nothing: the
gateway and the vLLM connector read these through common/widths.py, the towers in models/ directly."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

QWEN2_VL: Mapping[str, Any] = MappingProxyType(
    {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 3584,
        "hidden_act": "quick_gelu",
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
)
"""Qwen2VLVisionConfig's (hidden_size is the merged rows' width, embed_dim the blocks')."""
QWEN2_5_VL: Mapping[str, Any] = MappingProxyType(
    {
        "depth": 32,
        "hidden_size": 3584,
        "hidden_act": "silu",
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "out_hidden_size": 3584,
        "fullatt_block_indexes": (7, 15, 23, 31),
    }
)
"""Qwen2_5_VLVisionConfig's (Qwen2_5OmniVisionEncoderConfig's too)."""
QWEN3_5: Mapping[str, Any] = MappingProxyType(
    {
        "depth": 27,
        "hidden_size": 1152,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 3584,
        "num_position_embeddings": 2304,
    }
)
"""Qwen3_5VisionConfig's and Qwen3_5MoeVisionConfig's (no DeepStack)."""
QWEN3_VL: Mapping[str, Any] = MappingProxyType({**QWEN3_5, "deepstack_visual_indexes": (8, 16, 24)})
"""Qwen3VLVisionConfig's, Qwen3VLMoeVisionConfig's and Qwen3OmniMoeVisionEncoderConfig's."""

VISION_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "qwen2_vl": QWEN2_VL,
        "qwen2_5_vl": QWEN2_5_VL,
        "qwen3_vl": QWEN3_VL,
        "qwen3_vl_moe": QWEN3_VL,
        "qwen3_5": QWEN3_5,
        "qwen3_5_moe": QWEN3_5,
        "qwen2_5_omni": QWEN2_5_VL,
        "qwen3_omni_moe": QWEN3_VL,
    }
)
"""A checkpoint's model_type -> the defaults of its (thinker's) vision tower."""


def vision_config(model_type: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's vision_config with every key it leaves out at its family's transformers default (unchanged for
    a model_type without a table here)."""
    return {**VISION_DEFAULTS.get(model_type, {}), **given}
