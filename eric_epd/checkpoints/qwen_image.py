"""Offline Qwen-Image checkpoints for Geri: random weights, real diffusers configs, written by diffusers' own
`save_pretrained` as a QwenImagePipeline without its text encoder (Geri takes prompt embeddings from outside)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BUILDER_VERSION = 1  # bump when the output of build_qwen_image_checkpoint changes

SIZES = {
    "tiny": {
        "num_layers": 2,
        "attention_head_dim": 32,
        "num_attention_heads": 4,
        "joint_attention_dim": 128,
        "axes_dims_rope": (8, 12, 12),
    },
    "small": {
        "num_layers": 4,
        "attention_head_dim": 64,
        "num_attention_heads": 8,
        "joint_attention_dim": 256,
        "axes_dims_rope": (16, 24, 24),
    },
}


def build_qwen_image_checkpoint(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0) -> Path:
    """A QwenImagePipeline checkpoint (transformer, VAE, scheduler; no text encoder or tokenizer) in out_dir."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    out = Path(out_dir)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**SIZES[size])
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.0] * 16,
        latents_std=[1.0] * 16,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        max_image_seq_len=8192,
        base_shift=0.5,
        max_shift=0.9,
        shift_terminal=0.02,
        use_dynamic_shifting=True,
        time_shift_type="exponential",
    )
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.save_pretrained(out, safe_serialization=True)
    logger.info(
        "built qwen_image/%s checkpoint at %s: %.2fM transformer params",
        size,
        out,
        sum(p.numel() for p in transformer.parameters()) / 1e6,
    )
    return out


def ensure_qwen_image_checkpoint(size: str = "tiny", seed: int = 0) -> Path:
    """The cached offline Qwen-Image checkpoint (Geri's built-in default), built on first use."""
    from eric_epd.checkpoints.builtin import ensure_built

    return ensure_built(
        f"qwen_image-{size}-s{seed}-v{BUILDER_VERSION}",
        "model_index.json",
        lambda out: build_qwen_image_checkpoint(out, size, seed),
    )
