"""Tiny (model config, processor) makers for the generic families whose towers see fixed-size tiles or crops:
Gemma 3 (pan-and-scan), InternVL 3, LLaVA-OneVision, Idefics3, SmolVLM and Llama 4 (checkpoints/families.py)."""

from __future__ import annotations

from typing import Any

from eric_epd.checkpoints.text_parts import NEWLINES, Tokens, _text

SIGLIP = dict(
    model_type="siglip_vision_model",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=64,
    patch_size=16,
    vision_use_head=False,
)
"""A 64-pixel SigLIP tower: 4x4 patches of 16 pixels; no pooling head (as Gemma 3's and LLaVA-OneVision's)."""
RELEASED_SIGLIP = {"vision_tower.": "vision_tower.vision_model."}
"""transformers 5 saves a SigLIP tower without the `vision_model` level that released checkpoints have (it reads
both); vLLM reads only the released names ("no module or parameter named 'vision_tower.embeddings'")."""


GEMMA3 = Tokens(
    (
        "<pad>",
        "<eos>",
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ),
    {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    plain=NEWLINES,
)


def make_gemma3(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """SigLIP 64/16 pooled to 2x2 tokens per crop; pan-and-scan on, so a wide image gets crops after the original."""
    from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3Processor

    cfg = Gemma3Config(
        text_config={
            "model_type": "gemma3_text",
            **_text(vocab, ids, GEMMA3, init_std),
            "sliding_window": 64,
            "query_pre_attn_scalar": 32,
        },
        vision_config={**SIGLIP, "initializer_range": init_std},
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        initializer_range=init_std,
    )
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    improc = Gemma3ImageProcessor(
        size={"height": 64, "width": 64},
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=32,
        pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    return cfg, Gemma3Processor(improc, tok, image_seq_length=4)


INTERNVL = Tokens(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
    {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    eos="<|im_end|>",
)


def make_internvl(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """InternViT 64/16 with pixel shuffle 0.5: 4 tokens per 64-pixel tile, up to 6 tiles and a thumbnail."""
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor

    cfg = InternVLConfig(
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": [64, 64],
            "patch_size": [16, 16],
            "initializer_range": init_std,
        },
        text_config={"model_type": "qwen2", **_text(vocab, ids, INTERNVL, init_std)},
        image_token_id=ids["<IMG_CONTEXT>"],
        downsample_ratio=0.5,
        initializer_range=init_std,
    )
    cfg.architectures = ["InternVLForConditionalGeneration"]
    improc = GotOcr2ImageProcessor(
        size={"height": 64, "width": 64},
        crop_to_patches=True,
        min_patches=1,
        max_patches=6,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    video = InternVLVideoProcessor(
        size={"height": 64, "width": 64}, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
    )
    return cfg, InternVLProcessor(improc, tok, video, image_seq_length=4)


QWEN_CHAT = Tokens(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"),
    {"image_token": "<image>", "video_token": "<video>"},
    eos="<|im_end|>",
)
PINPOINTS = [[64, 64], [64, 128], [128, 64], [128, 128], [64, 192], [192, 64]]


def make_llava_onevision(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """SigLIP 64/16, anyres over 64-pixel tiles with an image_newline row per grid row (as released: last layer,
    "full" strategy)."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    cfg = LlavaOnevisionConfig(
        vision_config={**SIGLIP, "initializer_range": init_std},
        text_config={"model_type": "qwen2", **_text(vocab, ids, QWEN_CHAT, init_std)},
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
    )
    cfg.architectures = ["LlavaOnevisionForConditionalGeneration"]
    improc = LlavaOnevisionImageProcessor(size={"height": 64, "width": 64}, image_grid_pinpoints=PINPOINTS)
    video = LlavaOnevisionVideoProcessor(size={"height": 64, "width": 64})
    return cfg, LlavaOnevisionProcessor(
        improc,
        tok,
        video,
        num_image_tokens=16,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
    )


IDEFICS3 = Tokens(
    (
        "<|endoftext|>",
        "<|im_start|>",
        "<end_of_utterance>",
        "<fake_token_around_image>",
        "<image>",
        "<global-img>",
        *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
    ),
    {"image_token": "<image>"},
    bos="<|im_start|>",
    eos="<end_of_utterance>",
)


def _idefics_config(config_class: Any, ids: dict[str, int], vocab: int, init_std: float) -> Any:
    """An Idefics3-layout config (Idefics3, SmolVLM): SigLIP 64/16 with pixel shuffle 2, a Llama text model."""
    cfg = config_class(
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 64,
            "patch_size": 16,
            "initializer_range": init_std,
        },
        text_config={"model_type": "llama", **_text(vocab, ids, IDEFICS3, init_std)},
        scale_factor=2,
        image_token_id=ids["<image>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    cfg.architectures = [config_class.__name__.removesuffix("Config") + "ForConditionalGeneration"]
    return cfg


def make_idefics3(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """SigLIP 64/16 with pixel shuffle 2: 4 tokens per 64-pixel tile; images split into tiles up to 128 pixels a
    side, then the whole image."""
    from transformers import Idefics3Config, Idefics3ImageProcessor, Idefics3Processor

    improc = Idefics3ImageProcessor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    return _idefics_config(Idefics3Config, ids, vocab, init_std), Idefics3Processor(improc, tok, image_seq_len=4)


def make_smolvlm(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Idefics3's layout under SmolVLM's own classes (its processor also takes video; it needs num2words)."""
    from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    improc = SmolVLMImageProcessor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    video = SmolVLMVideoProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 64})
    return _idefics_config(SmolVLMConfig, ids, vocab, init_std), SmolVLMProcessor(improc, tok, video, image_seq_len=4)


LLAMA4 = Tokens(
    (
        "<|begin_of_text|>",
        "<|eot|>",
        "<|finetune_right_pad|>",
        "<|header_start|>",
        "<|header_end|>",
        "<|image_start|>",
        "<|image_end|>",
        "<|image|>",
        "<|patch|>",
        "<|tile_x_separator|>",
        "<|tile_y_separator|>",
    ),
    {},
    bos="<|begin_of_text|>",
    eos="<|eot|>",
    pad="<|finetune_right_pad|>",
)


def make_llama4(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Llama 4's tower at 16-pixel patches on 64-pixel tiles, pixel shuffle 0.5 (4 tokens a tile), up to 4 tiles
    and a global one; a mixture-of-experts language model of 2 experts whose chunked attention spans 128 tokens
    (vLLM's CPU blocks are 128: "attn_chunk_size 64 is not divisible by block_size 128")."""
    from transformers import Llama4Config, Llama4ImageProcessor, Llama4Processor

    cfg = Llama4Config(
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 64,
            "patch_size": 16,
            "vision_output_dim": 64,
            "projector_input_dim": 64,
            "projector_output_dim": 64,
            "pixel_shuffle_ratio": 0.5,
            "initializer_range": init_std,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        text_config={
            **_text(vocab, ids, LLAMA4, init_std),
            "intermediate_size_mlp": 128,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "attention_chunk_size": 128,
        },
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
    )
    cfg.architectures = ["Llama4ForConditionalGeneration"]
    improc = Llama4ImageProcessor(size={"height": 64, "width": 64}, max_patches=4)
    return cfg, Llama4Processor(improc, tok, patch_size=16, pixel_shuffle_ratio=0.5)
