"""The one rule for the width of an embedding row, read off a checkpoint's config.json alone: which model_types have
a hand-written tower (TOWER_TYPES), and embedding_width. Imports no torch and nothing above common/: the gateway and
the vLLM connector reach it through wire/handoff, Eric through models/facts.py (ModelFacts)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from eric_epd.common.tower_defaults import vision_config

TOWER_TYPES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {t: ("image", "video") for t in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")}
)
"""The model_types a hand-written tower serves (models/registry.py), with their modalities; every other type takes
the generic path (images)."""


def is_generic(config: Mapping[str, Any]) -> bool:
    """No hand-written tower serves this checkpoint's model_type: Eric's generic path (models/hf) does, if it can."""
    return config.get("model_type", "") not in TOWER_TYPES


def embedding_width(config: Mapping[str, Any], modality: str = "image") -> int:
    """Width of one embedding row a checkpoint's tower hands its language model for a `modality` item, from its
    config.json (or a transformers config's to_dict()). A vision row is the merged token's width times (1 +
    DeepStack levels), laid out [merged | level 1 | ... | level k] as the engines' own encoders produce them: for a
    hand-written tower, and for an Omni thinker whose vision tower has DeepStack taps (Qwen3-Omni); otherwise, on
    the generic path, a row is the language model's hidden size, as is every audio row."""
    model_type = str(config.get("model_type", ""))
    if is_generic(config):  # 0 for a config without one: registry.check_servable then says what is missing
        inner = config.get("thinker_config") or config  # an Omni checkpoint: its thinker's language model
        hidden = int((inner.get("text_config") or inner).get("hidden_size", 0))
        vision = vision_config(model_type, inner.get("vision_config") or {}) if "thinker_config" in config else {}
        levels = len(vision.get("deepstack_visual_indexes") or ())
        if modality == "audio" or not levels:
            return hidden
        return int(vision.get("out_hidden_size") or hidden) * (1 + levels)
    vision = vision_config(model_type, config.get("vision_config") or {})
    levels = len(vision.get("deepstack_visual_indexes") or ())
    return int(vision.get("out_hidden_size") or vision["hidden_size"]) * (1 + levels)


def embedding_widths(config: Mapping[str, Any]) -> dict[str, int]:
    """embedding_width of every modality ("image", "video", "audio"): equal for every family but an Omni thinker with
    DeepStack, whose vision rows are wider than its audio rows."""
    return {modality: embedding_width(config, modality) for modality in ("image", "video", "audio")}
