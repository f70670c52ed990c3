"""InternVL 3's vision encoders on batches of 8 crops (concurrency 8): Eric's own tower (models/internvl.py, behind the
generic runner's interface), the generic path's encoder and transformers' full model (encoder_throughput_towers.py
says how). The checkpoint is InternVL3-1B-shaped but scaled down to run on one CPU core in about a minute (see
SCALE). Run as `python benchmarks/encoder_throughput.py --family internvl`; writes
benchmarks/results/encoder_throughput_internvl.{json,png}.
"""

from __future__ import annotations

from pathlib import Path

import torch
from encoder_throughput_towers import BATCH, TowerBench, floor_attention_s, floor_linear_s  # a sibling script

VISION = {
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "image_size": [448, 448],
    "patch_size": [14, 14],
}
"""InternViT-300M-448px as in InternVL3-1B and -2B (width 1024 = 16 heads of 64, MLP 4096, 24 layers, LayerNorm, no
qk-norm, 448 px: 32x32 = 1024 patches and the cls token, pixel-shuffled 2x2 to 256 tokens of 4096) scaled down:
width 384 = 6 heads of 64 (0.375x), MLP 1536 (the same 4x ratio), 4 layers, the same 448 px crops and shuffle."""
PATCHES, TOKENS, TEXT_WIDTH = 1024, 256, 336
"""Patches per crop (the cls token makes 1025 tokens), rows per crop, and the row width: Qwen2.5-0.5B's 896
(InternVL3-1B) scaled as the tower (0.375x)."""
SCALE = (
    "InternViT-300M/14 (InternVL3-1B) scaled: width 384 (6 heads of 64), MLP 1536, 4 layers, 448 px crops "
    "(1024 patches + cls) pixel-shuffled to 256 tokens of 1536, projected to width 336"
)


def build(out: Path) -> None:
    """A random InternVL checkpoint of these dimensions (a one-layer language model: get_image_features never runs
    it); constant-initialised tensors (unit norms, layer scales, zero biases) get noise."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from eric_epd.checkpoints.saving import jitter_constants

    text = {
        "model_type": "qwen2",
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 2 * TEXT_WIDTH,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "vocab_size": 1024,
    }
    cfg = InternVLConfig(text_config=text, vision_config=VISION, image_token_id=1000, downsample_ratio=0.5)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(cfg).to(torch.float32).eval()
    jitter_constants(model, 0.02)
    model.save_pretrained(out)


def floor_s(dtype: torch.dtype) -> float:
    """The patch conv as a GEMM, 4 layers of (qkv, projection_layer, fc1, fc2, attention over 1025 tokens), the
    projector's two linears."""
    n, d, mlp, heads, layers = BATCH * (PATCHES + 1), VISION["hidden_size"], VISION["intermediate_size"], 6, 4
    per_layer = (
        floor_linear_s(n, d, 3 * d, dtype)
        + floor_linear_s(n, d, d, dtype)
        + floor_linear_s(n, d, mlp, dtype)
        + floor_linear_s(n, mlp, d, dtype)
        + floor_attention_s(heads, PATCHES + 1, d // heads, dtype)
    )
    patch = floor_linear_s(BATCH * PATCHES, 3 * 14 * 14, d, dtype)
    projector = floor_linear_s(BATCH * TOKENS, 4 * d, TEXT_WIDTH, dtype) + floor_linear_s(
        BATCH * TOKENS, TEXT_WIDTH, TEXT_WIDTH, dtype
    )
    return patch + layers * per_layer + projector


BENCH = TowerBench("internvl", "InternVL 3", "internvl-bench-s0-v1", SCALE, build, 448, TOKENS, floor_s)


def main(dtypes: list[str], rounds: int) -> dict:
    """Measure, write encoder_throughput_internvl.{json,png} and log the table."""
    from encoder_throughput_towers import main as towers_main

    return towers_main(BENCH, dtypes, rounds)
