"""Analytic cost of one image token on each side of EPD (floating-point operations), read from a Qwen2-VL / Qwen2.5-VL
config.json: the vision tower's work per image token, the language model's prefill work per token and its decode work
per output token. The shaped benchmark checkpoints are sized so that their ratios match the released models'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN25_VL_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "in_chans": 3,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "hidden_act": "silu",
}
REFERENCES: dict[str, dict[str, Any]] = {
    "Qwen2.5-VL-3B-Instruct": {
        "model_type": "qwen2_5_vl",
        "vision_config": {**QWEN25_VL_VISION, "out_hidden_size": 2048},
        "text_config": {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
        },
    },
    "Qwen2.5-VL-7B-Instruct": {
        "model_type": "qwen2_5_vl",
        "vision_config": {**QWEN25_VL_VISION, "out_hidden_size": 3584},
        "text_config": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        },
    },
}
"""The released configs' sizes (the Hugging Face repos' config.json, the fields the cost reads)."""

IMAGE_SIDE = 448
"""The image the attention terms assume: 448 x 448 px, 1,024 patches, 256 image tokens."""
CONTEXT = 1024
"""The context the language model's attention terms assume: a prompt of 4 such images."""


@dataclass(frozen=True)
class StageCosts:
    """FLOPs per image token in the tower, per prompt token in prefill and per output token in decode."""

    encoder_per_image_token: float
    prefill_per_token: float
    decode_per_token: float

    def ratios(self) -> dict[str, float]:
        """Prefill and decode work per token over the tower's work per image token."""
        return {
            "prefill_over_encoder": self.prefill_per_token / self.encoder_per_image_token,
            "decode_over_encoder": self.decode_per_token / self.encoder_per_image_token,
        }


def _vision(config: dict[str, Any]) -> dict[str, Any]:
    v = dict(config["vision_config"])
    v.setdefault("hidden_size", v.get("embed_dim"))
    if "intermediate_size" not in v:  # Qwen2-VL: an fc1/fc2 MLP of mlp_ratio x the width
        v["intermediate_size"] = int(v["hidden_size"] * v.get("mlp_ratio", 4))
    return v


def encoder_flops_per_image_token(config: dict[str, Any], side: int = IMAGE_SIDE) -> float:
    """The tower's FLOPs per image token (spatial_merge_size^2 patches) for a side x side image: patch embedding,
    attention projections, MLP (gated for Qwen2.5-VL), attention scores (windowed blocks over their window, full
    blocks over the image) and the merger into the language model's width."""
    v = _vision(config)
    w, m, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    patch, merge = v.get("patch_size", 14), v.get("spatial_merge_size", 2)
    patches = (side // patch) ** 2
    full = v.get("fullatt_block_indexes")
    windowed = 0 if full is None else depth - len(full)
    window = (v.get("window_size", side) // patch) ** 2
    gated = config.get("model_type") == "qwen2_5_vl"
    per_patch = 2 * v.get("in_chans", 3) * v.get("temporal_patch_size", 2) * patch * patch * w
    linear = 4 * w * w + (3 if gated else 2) * w * m
    per_patch += depth * 2 * linear
    per_patch += 4 * w * (windowed * window + (depth - windowed) * patches)
    out = v.get("out_hidden_size") or config["text_config"]["hidden_size"]
    merged = merge * merge * w
    merger = 2 * (merged * merged + merged * out)
    return merge * merge * per_patch + merger


def _text_linear_params(t: dict[str, Any]) -> float:
    h, heads = t["hidden_size"], t["num_attention_heads"]
    head_dim = t.get("head_dim") or h // heads
    kv = t.get("num_key_value_heads", heads) * head_dim
    attn = h * heads * head_dim * 2 + 2 * h * kv
    return t["num_hidden_layers"] * (attn + 3 * h * t["intermediate_size"])


def prefill_flops_per_token(config: dict[str, Any], context: int = CONTEXT) -> float:
    """The language model's FLOPs per prompt token: its linear layers, and causal attention over half the context
    on average (the LM head runs once per prompt, so it is left out)."""
    t = config["text_config"]
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    attention = 4 * t["num_hidden_layers"] * t["num_attention_heads"] * head_dim * context / 2
    return 2 * _text_linear_params(t) + attention


def decode_flops_per_token(config: dict[str, Any], context: int = CONTEXT) -> float:
    """The language model's FLOPs per output token: its linear layers, attention over the whole context, and the LM
    head over the vocabulary."""
    t = config["text_config"]
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    attention = 4 * t["num_hidden_layers"] * t["num_attention_heads"] * head_dim * context
    return 2 * _text_linear_params(t) + attention + 2 * t["hidden_size"] * t["vocab_size"]


def stage_costs(config: dict[str, Any]) -> StageCosts:
    """The three per-token costs of a checkpoint's config.json (as a dict)."""
    return StageCosts(
        encoder_flops_per_image_token(config), prefill_flops_per_token(config), decode_flops_per_token(config)
    )
