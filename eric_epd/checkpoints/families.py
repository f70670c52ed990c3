"""Offline builders of tiny random checkpoints for the families Eric serves through its generic path (Gemma 3 and 4,
InternVL 3, LLaVA-OneVision, Mistral 3, GLM-4.1V and -4.5V, Idefics3, SmolVLM, Llama 4, Kimi-K2.5), saved like a
Hugging Face repo.

Each holds random weights, a locally trained tokenizer carrying the family's special tokens, the family's own
processor classes saved with their defaults (sizes shrunk to the tiny tower) and a chat template. Nothing is
downloaded; deterministic by seed. Sizes keep vLLM's CPU build able to load them: text heads of 32, image tokens
inside the vocabulary, processor settings that agree with the model config.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eric_epd.checkpoints.kimi import KIMI_IMAGE, KIMI_NAMED, KIMI_SPECIALS, finish_kimi_k25, make_kimi_k25
from eric_epd.checkpoints.saving import build_tiny_checkpoint, ensure_tiny_checkpoint
from eric_epd.checkpoints.text_parts import Tokens, _template, _text

BUILDER_VERSION = 6  # bump when the output of build_family_checkpoint changes

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


@dataclass(frozen=True)
class Family:
    """How to build one family: its tokens, chat template and a maker of (model config, processor)."""

    tokens: Tokens
    chat_template: str
    make: Callable[[Any, dict[str, int], int, float], tuple[Any, Any]]
    """(tokenizer, token ids, vocab size, init std) -> (model config, processor)."""
    released: dict[str, str] = field(default_factory=dict)
    """Saved tensor-name prefixes renamed to those of the family's released checkpoints (what vLLM reads)."""
    finish: Callable[[Path, Any], None] | None = None
    """(checkpoint dir, model) -> None: the family's last touches to what was saved (its released layout)."""


# ---- families ------------------------------------------------------------------------------------------------


NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
"""Gemma's vocabulary has runs of newlines as tokens; vLLM's Gemma 3 reads their ids."""
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


def _gemma3(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
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


def _internvl(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
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


def _llava_onevision(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
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


MISTRAL3 = Tokens(
    ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    {"image_token": "[IMG]"},
    bos="<s>",
    eos="</s>",
    pad="<unk>",
)


def _mistral3(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Pixtral 16-pixel patches merged 2x2: one token per 32x32 pixels, images up to 128 pixels a side."""
    from transformers import Mistral3Config, PixtralImageProcessor, PixtralProcessor

    cfg = Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 32,
            "image_size": 128,
            "patch_size": 16,
            "initializer_range": init_std,
        },
        text_config={"model_type": "mistral", **_text(vocab, ids, MISTRAL3, init_std)},
        spatial_merge_size=2,
        vision_feature_layer=-1,
        image_token_index=ids["[IMG]"],
        multimodal_projector_bias=False,
    )
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    improc = PixtralImageProcessor(size={"longest_edge": 128}, patch_size={"height": 16, "width": 16})
    return cfg, PixtralProcessor(improc, tok, patch_size=16, spatial_merge_size=2)


GLM4V = Tokens(
    (
        "<|endoftext|>",
        "[gMASK]",
        "<sop>",
        "<|user|>",
        "<|assistant|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
        "<|video|>",
    ),
    {"image_token": "<|image|>", "video_token": "<|video|>"},
    eos="<|endoftext|>",
)


GLM45V_MOE = {
    "model_type": "glm4v_moe_text",
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "use_qk_norm": False,
}
"""GLM-4.5V's language model: GLM-4.1V's with a mixture of 2 experts after its first (dense) layer (vLLM reads
`use_qk_norm`, which transformers' config does not define)."""


def _glm4v(tok: Any, ids: dict[str, int], vocab: int, init_std: float, moe: bool = False) -> tuple[Any, Any]:
    """GLM-4.1V's tower at 14-pixel patches merged 2x2, 56x56 to 112x112 pixels per image (GLM-4.5V: the same tower
    and processor before a mixture-of-experts language model)."""
    import transformers
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}
    text = _text(vocab, ids, GLM4V, init_std, rope_parameters=rope, **(GLM45V_MOE if moe else {}))
    name = "Glm4vMoe" if moe else "Glm4v"
    cfg = getattr(transformers, f"{name}Config")(
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "out_hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "image_size": 56,
            "initializer_range": init_std,
        },
        text_config=text,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )
    cfg.architectures = [f"{name}ForConditionalGeneration"]
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    improc = Glm4vImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    video = Glm4vVideoProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    return cfg, Glm4vProcessor(improc, tok, video)


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


def _idefics3(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """SigLIP 64/16 with pixel shuffle 2: 4 tokens per 64-pixel tile; images split into tiles up to 128 pixels a
    side, then the whole image."""
    from transformers import Idefics3Config, Idefics3ImageProcessor, Idefics3Processor

    improc = Idefics3ImageProcessor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    return _idefics_config(Idefics3Config, ids, vocab, init_std), Idefics3Processor(improc, tok, image_seq_len=4)


def _smolvlm(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Idefics3's layout under SmolVLM's own classes (its processor also takes video; it needs num2words)."""
    from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    improc = SmolVLMImageProcessor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    video = SmolVLMVideoProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 64})
    return _idefics_config(SmolVLMConfig, ids, vocab, init_std), SmolVLMProcessor(improc, tok, video, image_seq_len=4)


GEMMA4 = Tokens(
    (
        "<pad>",
        "<eos>",
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<|image>",
        "<|image|>",
        "<image|>",
        "<|video|>",
        "<|audio>",
        "<|audio|>",
        "<audio|>",
    ),
    {
        "boi_token": "<|image>",
        "image_token": "<|image|>",
        "eoi_token": "<image|>",
        "boa_token": "<|audio>",
        "audio_token": "<|audio|>",
        "eoa_token": "<audio|>",
    },
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    plain=NEWLINES,
)


def _gemma4(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Gemma 4's tower at 16-pixel patches pooled 2x2, at most 70 soft tokens an image (its smallest budget); no
    audio tower."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    cfg = Gemma4Config(
        text_config={
            **_text(vocab, ids, GEMMA4, init_std),
            "vocab_size_per_layer_input": vocab,
            "hidden_size_per_layer_input": 8,
            "sliding_window": 64,
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "pooling_kernel_size": 2,
            "patch_size": 16,
            "position_embedding_size": 64,
            "default_output_length": 70,
            "initializer_range": init_std,
        },
        audio_config=None,
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"],
        initializer_range=init_std,
    )
    cfg.architectures = ["Gemma4ForConditionalGeneration"]
    improc = Gemma4ImageProcessor(patch_size=16, max_soft_tokens=70, pooling_kernel_size=2)
    video = Gemma4VideoProcessor(patch_size=16, max_soft_tokens=70, pooling_kernel_size=2)
    return cfg, Gemma4Processor(Gemma4AudioFeatureExtractor(), improc, tok, video, image_seq_length=70)


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


def _llama4(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
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


KIMI = Tokens(KIMI_SPECIALS, KIMI_NAMED, bos="[BOS]", eos="<|im_end|>", pad="[EOS]")


def _kimi_k25(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """MoonViT 14-pixel patches merged 2x2 (checkpoints/kimi.py), a DeepSeek-V3 language model with MLA."""
    return make_kimi_k25(tok, ids, _text(vocab, ids, KIMI, init_std), init_std)


FAMILY_GLM_TEMPLATE = _template(
    "<|user|>\n",
    "<|assistant|>\n",
    "",
    "<|begin_of_image|><|image|><|end_of_image|>",
    "[gMASK]<sop>",
    "<|begin_of_video|><|video|><|end_of_video|>",
)
"""GLM-4.1V's and GLM-4.5V's chat template."""

FAMILIES: dict[str, Family] = {
    "gemma3": Family(
        GEMMA3,
        _template(
            "<start_of_turn>user\n", "<start_of_turn>model\n", "<end_of_turn>\n", "<start_of_image>", "{{ bos_token }}"
        ),
        _gemma3,
        RELEASED_SIGLIP,
    ),
    "internvl": Family(
        INTERNVL,
        _template(
            "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n", "<IMG_CONTEXT>\n", video="<video>\n"
        ),
        _internvl,
    ),
    "llava_onevision": Family(
        QWEN_CHAT,
        _template("<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n", "<image>\n", video="<video>\n"),
        _llava_onevision,
        RELEASED_SIGLIP,
    ),
    "mistral3": Family(MISTRAL3, _template("[INST]", "", "[/INST]", "[IMG]", "{{ bos_token }}"), _mistral3),
    "glm4v": Family(GLM4V, FAMILY_GLM_TEMPLATE, _glm4v),
    "glm4v_moe": Family(GLM4V, FAMILY_GLM_TEMPLATE, functools.partial(_glm4v, moe=True)),
    "idefics3": Family(
        IDEFICS3, _template("User:", "Assistant:", "<end_of_utterance>\n", "<image>", "<|im_start|>"), _idefics3
    ),
    "smolvlm": Family(
        IDEFICS3, _template("User:", "Assistant:", "<end_of_utterance>\n", "<image>", "<|im_start|>"), _smolvlm
    ),
    "gemma4": Family(
        GEMMA4,
        _template(
            "<start_of_turn>user\n",
            "<start_of_turn>model\n",
            "<end_of_turn>\n",
            "<|image|>",
            "{{ bos_token }}",
            "<|video|>",
        ),
        _gemma4,
    ),
    "llama4": Family(
        LLAMA4,
        _template(
            "<|header_start|>user<|header_end|>\n\n",
            "<|header_start|>assistant<|header_end|>\n\n",
            "<|eot|>",
            "<|image|>",
            "{{ bos_token }}",
        ),
        _llama4,
    ),
    "kimi_k25": Family(
        KIMI,
        _template("<|im_user|>user<|im_middle|>", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>", KIMI_IMAGE),
        _kimi_k25,
        finish=finish_kimi_k25,
    ),
}
"""Family name (its HF model_type) -> how to build its tiny checkpoint."""


def build_family_checkpoint(out_dir: str | os.PathLike, family: str, seed: int = 0, init_std: float = 0.1) -> Path:
    """Write a complete random checkpoint of `family` (config, safetensors, tokenizer, processor configs, chat
    template) to `out_dir`."""
    from transformers import AutoModelForImageTextToText

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; families {sorted(FAMILIES)}")
    return build_tiny_checkpoint(out_dir, family, FAMILIES[family], AutoModelForImageTextToText, seed, init_std)


def ensure_family_checkpoint(family: str, seed: int = 0) -> Path:
    """The cached tiny checkpoint of `family`, built atomically on first use."""
    return ensure_tiny_checkpoint(family, seed, f"f{BUILDER_VERSION}", build_family_checkpoint)
