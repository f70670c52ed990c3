"""The tiny Kimi-K2.5 checkpoint: MoonViT (14-pixel patches merged 2x2) and its projector before a DeepSeek-V3
language model, saved in the released checkpoints' layout, which both transformers and vLLM read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

KIMI_SPECIALS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)
KIMI_NAMED = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}
KIMI_IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
"""What an image part becomes in the prompt (vLLM's `get_placeholder_str` for the family)."""

MAX_SIDE_PATCHES = 8
"""Images are scaled to at most 8 patches (112 pixels) a side and ..."""
MAX_PATCHES = 64
"""... 64 patches in all, so test images both keep their size and get scaled down."""

MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None)
"""vLLM's CPU MLA kernel takes only a latent of 512 + 64 (`get_supported_head_sizes`: 576)."""

RELEASED_FIXES = (
    (r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
    (r"^model\.mm_projector\.", "mm_projector."),
)
"""transformers 5.19 saves the vision tower and projector back in the released names (wqkv, wo, fc0/fc1, norm0/norm1,
proj.0/proj.2) but for these two prefixes, which its loader and vLLM read only in the released form."""


def make_kimi_k25(tok: Any, ids: dict[str, int], text: dict[str, Any], init_std: float) -> tuple[Any, Any]:
    """(config, processor) of the tiny Kimi-K2.5: `text` is the shared tiny language model's settings, made
    DeepSeek-V3 with MLA and dense MLPs (first_k_dense_replace covers every layer)."""
    from transformers import Kimi_K25Config, Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    deepseek = {
        "model_type": "deepseek_v3",
        **{k: v for k, v in text.items() if k != "head_dim"},
        **MLA,
        "num_key_value_heads": text["num_attention_heads"],
        "first_k_dense_replace": text["num_hidden_layers"],
        "n_routed_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 64,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    vision = {
        "patch_size": 14,
        "pos_emb_height": 16,
        "pos_emb_width": 16,
        "pos_emb_time": 4,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "merge_kernel_size": [2, 2],
        "initializer_range": init_std,
    }
    cfg = Kimi_K25Config(
        text_config=deepseek,
        vision_config=vision,
        projection_hidden_size=64,
        image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        initializer_range=init_std,
    )
    cfg.use_unified_vision_chunk = True  # vLLM: image parts are "vision_chunk" items
    size = {"max_height": MAX_SIDE_PATCHES, "max_width": MAX_SIDE_PATCHES}
    improc = Kimi_K25ImageProcessor(size=size, max_patches=MAX_PATCHES, patch_size=14, merge_size=2)
    video = Kimi_K25VideoProcessor(size=size, patch_size=14, merge_size=2)
    return cfg, Kimi_K25Processor(improc, tok, video)


def media_proc_cfg(image_processor: dict[str, Any]) -> dict[str, Any]:
    """The released checkpoints' `media_proc_cfg` (what vLLM's Kimi image processor reads) for transformers'
    image-processor settings: the same limits under the released names."""
    return {
        "in_patch_limit": image_processor["max_patches"],
        "patch_limit_on_one_side": image_processor["size"]["max_height"],
        "patch_size": image_processor["patch_size"],
        "merge_kernel_size": image_processor["merge_size"],
        "image_mean": image_processor["image_mean"],
        "image_std": image_processor["image_std"],
        "fixed_output_tokens": None,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "media_proc",
    }


def finish_kimi_k25(out: Path, model: torch.nn.Module) -> None:
    """Make the saved checkpoint the released layout: tensor names, vLLM's architecture name, the media token's
    released name, `media_proc_cfg`."""
    _released_tensors(out / "model.safetensors", model)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["media_placeholder_token_id"] = config["image_token_id"]  # the released config's name, which SGLang reads
    config_path.write_text(json.dumps(config, indent=2))
    processor_path = out / "processor_config.json"
    processor = json.loads(processor_path.read_text())
    processor["image_processor"]["media_proc_cfg"] = media_proc_cfg(processor["image_processor"])
    processor_path.write_text(json.dumps(processor, indent=2))


def _released_tensors(path: Path, model: torch.nn.Module) -> None:
    """The vision tower and projector as transformers saved them (their released names, two prefixes fixed); the
    language model straight from the model under `language_model.` (transformers' save renames its layers with the
    vision tower's rules and permutes its q_proj as if it were the tower's)."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, value in load_file(path).items():
        if name.startswith("language_model."):
            continue
        for pattern, replacement in RELEASED_FIXES:
            name = re.sub(pattern, replacement, name)
        tensors[name] = value
    for name, value in model.state_dict().items():
        if name.startswith("model.language_model."):
            tensors["language_model.model." + name.removeprefix("model.language_model.")] = value.contiguous()
        elif name.startswith("lm_head."):
            tensors["language_model." + name] = value.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
