"""Gemma 3's vision encoders on batches of 8 crops (concurrency 8): Eric's own tower (models/gemma3.py, behind the
generic runner's interface), the generic path's encoder and transformers' full model (encoder_throughput_towers.py
says how). The checkpoint is Gemma-3-shaped but scaled down to run on one CPU core in about a minute (see SCALE).
Run as `python benchmarks/encoder_throughput.py --family gemma3`; writes
benchmarks/results/encoder_throughput_gemma3.{json,png}.
"""

from __future__ import annotations

from pathlib import Path

import torch
from encoder_throughput_towers import BATCH, TowerBench, floor_attention_s, floor_linear_s  # a sibling script

VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 432,
    "intermediate_size": 1614,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "image_size": 448,
    "patch_size": 14,
    "vision_use_head": False,
}
"""SigLIP-So400m/14 at 896 px as in Gemma 3 (width 1152 = 16 heads of 72, MLP 4304, 27 layers, 64x64 patches pooled
4x4 to 256 tokens) scaled down: width 432 = 6 heads of 72 (0.375x), MLP 1614 (the same 3.74 ratio), 4 layers, 448 px
(32x32 = 1024 patches, pooled 4x4 to 64 tokens: the same pooling)."""
TOKENS, TEXT_WIDTH = 64, 640
SCALE = (
    "SigLIP-So400m/14 (Gemma 3) scaled: width 432 (6 heads of 72), MLP 1614, 4 layers, 448 px crops "
    "(1024 patches) pooled 4x4 to 64 tokens of width 640"
)


def build(out: Path) -> None:
    """A random Gemma 3 checkpoint of these dimensions (a one-layer language model: get_image_features never runs
    it); constant-initialised tensors (the zero projection) get noise so rows are not all zero."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {
        "model_type": "gemma3_text",
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 1280,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 1024,
    }
    cfg = Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=TOKENS,
        image_token_index=1000,
        boi_token_index=1001,
        eoi_token_index=1002,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and bool((param == param.reshape(-1)[0]).all()):
                param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(out)


def floor_s(dtype: torch.dtype) -> float:
    """The patch conv as a GEMM, 4 layers of (qkv, out_proj, fc1, fc2, attention over 1024 patches), the projection."""
    n, d, mlp, heads, layers = BATCH * 1024, VISION["hidden_size"], VISION["intermediate_size"], 6, 4
    per_layer = (
        floor_linear_s(n, d, 3 * d, dtype)
        + floor_linear_s(n, d, d, dtype)
        + floor_linear_s(n, d, mlp, dtype)
        + floor_linear_s(n, mlp, d, dtype)
        + floor_attention_s(heads, 1024, d // heads, dtype)
    )
    patch = floor_linear_s(n, 3 * 14 * 14, d, dtype)
    return patch + layers * per_layer + floor_linear_s(BATCH * TOKENS, d, TEXT_WIDTH, dtype)


BENCH = TowerBench("gemma3", "Gemma 3", "gemma3-bench-s0-v1", SCALE, build, VISION["image_size"], TOKENS, floor_s)


def main(dtypes: list[str], rounds: int) -> dict:
    """Measure, write encoder_throughput_gemma3.{json,png} and log the table."""
    from encoder_throughput_towers import main as towers_main

    return towers_main(BENCH, dtypes, rounds)
