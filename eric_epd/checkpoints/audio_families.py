"""Offline builders of tiny random checkpoints for the audio families Eric serves (Qwen2-Audio, Qwen2.5-Omni's
thinker), saved like a Hugging Face repo: random weights, a locally trained tokenizer carrying the family's special
tokens, the family's own processor classes (its Whisper feature extractor at the released settings) and the family's
chat template.

Nothing is downloaded; deterministic by seed. The audio towers keep the released input geometry (128 mel bins, 1500
positions) and shrink only their width and depth; the text side is the one every tiny family shares (heads of 32,
which vLLM's CPU attention takes)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eric_epd.checkpoints.saving import build_tiny_checkpoint, ensure_tiny_checkpoint
from eric_epd.checkpoints.text_parts import Tokens, _text

BUILDER_VERSION = 3  # bump when the output of build_audio_checkpoint changes


@dataclass(frozen=True)
class AudioFamily:
    """How to build one audio family: its tokens and a maker of (model config, processor with chat template)."""

    tokens: Tokens
    make: Callable[[Any, dict[str, int], int, float], tuple[Any, Any]]
    """(tokenizer, token ids, vocab size, init std) -> (model config, processor)."""
    released: dict[str, str]
    """Saved tensor-name prefixes renamed to those of the family's released checkpoints (what vLLM reads)."""
    chat_template: str | None = None
    """None: the one its `make` gives the processor."""
    finish: Callable[[Path, Any], None] | None = None
    """None: nothing done to what was saved."""


QWEN2_AUDIO = Tokens(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"), eos="<|im_end|>"
)
"""Qwen2-Audio's special tokens; its processor finds the audio ones by their default names."""


def _whisper_extractor(**settings: object) -> Any:
    """The released Qwen audio models' Whisper feature extractor (128 mel bins at 16 kHz, 10 ms hops), with the
    family's own `settings` (its chunk length; the Omni thinkers' dither off)."""
    from transformers import WhisperFeatureExtractor

    base = dict(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400, padding_value=0.0)
    return WhisperFeatureExtractor(**base, return_attention_mask=True, **settings)


def _qwen2_audio(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Qwen2-Audio's Whisper-style tower at width 64 and depth 2 over the released input (128 mel bins, 1500
    positions: 30 s), its linear projector, and its processor with the released feature-extractor settings and chat
    template (transformers keeps the released template as the processor's default)."""
    from transformers import Qwen2AudioConfig, Qwen2AudioProcessor

    cfg = Qwen2AudioConfig(
        audio_config={
            "d_model": 64,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "num_mel_bins": 128,
            "max_source_positions": 1500,
            "initializer_range": init_std,
        },
        text_config={"model_type": "qwen2", **_text(vocab, ids, QWEN2_AUDIO, init_std)},
        audio_token_index=ids["<|AUDIO|>"],
    )
    cfg.architectures = ["Qwen2AudioForConditionalGeneration"]
    extractor = _whisper_extractor(chunk_length=30)
    processor = Qwen2AudioProcessor(extractor, tok)
    processor.chat_template = processor.default_chat_template
    return cfg, processor


QWEN2_5_OMNI = Tokens(
    (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|AUDIO|>",
        "<|audio_bos|>",
        "<|audio_eos|>",
        "<|vision_bos|>",
        "<|vision_eos|>",
        "<|vision_pad|>",
        "<|IMAGE|>",
        "<|VIDEO|>",
    ),
    {
        "image_token": "<|IMAGE|>",
        "audio_token": "<|AUDIO|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    },
    eos="<|im_end|>",
)
"""Qwen2.5-Omni's special tokens, those its processor reads by name (`tokenizer.image_token`, ...) named."""
QWEN2_5_OMNI_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: "
    "{% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The released Qwen2.5-Omni chat template (the one transformers' Qwen2.5-Omni processor tests use)."""


def _qwen2_5_omni(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Qwen2.5-Omni as released (the thinker's config nested with the talker's and token2wav's) without audio
    output, so only the thinker is built and saved (`thinker.*`, the released names): its audio tower (chunked
    Whisper-style encoder, pooled and projected) and Qwen2.5-VL vision tower at width 64 and depth 2 (one windowed
    block, one full-attention block), and the processor with the released settings: the Whisper extractor padding
    to 300 s (`chunk_length` 300), the image and video processors at transformers' defaults (the released ones),
    the released chat template."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}  # halves of 32-wide heads
    thinker = dict(
        audio_config={
            "d_model": 64,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "num_mel_bins": 128,
            "max_source_positions": 1500,
            "n_window": 100,
            "output_dim": 64,
            "initializer_range": init_std,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "hidden_act": "silu",
            "initializer_range": init_std,
        },
        text_config=_text(vocab, ids, QWEN2_5_OMNI, init_std, rope_parameters=rope),
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        initializer_range=init_std,
    )
    cfg = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)  # saved as its model class, which
    # vLLM 0.32 maps to its thinker as it maps the released `Qwen2_5OmniModel`
    extractor = _whisper_extractor(chunk_length=300, dither=0.0)
    processor = Qwen2_5OmniProcessor(
        Qwen2VLImageProcessor(), Qwen2VLVideoProcessor(), extractor, tok, chat_template=QWEN2_5_OMNI_TEMPLATE
    )
    return cfg, processor


QWEN3_OMNI = Tokens(
    (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|audio_start|>",
        "<|audio_end|>",
        "<|audio_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    {
        "image_token": "<|image_pad|>",
        "audio_token": "<|audio_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    },
    eos="<|im_end|>",
)
"""Qwen3-Omni's special tokens (Qwen3's placeholder names), those its processor reads by name named."""
QWEN3_OMNI_TEMPLATE = (
    QWEN2_5_OMNI_TEMPLATE.replace("<|vision_bos|>", "<|vision_start|>")
    .replace("<|vision_eos|>", "<|vision_end|>")
    .replace("<|IMAGE|>", "<|image_pad|>")
    .replace("<|VIDEO|>", "<|video_pad|>")
    .replace("<|audio_bos|>", "<|audio_start|>")
    .replace("<|audio_eos|>", "<|audio_end|>")
    .replace("<|AUDIO|>", "<|audio_pad|>")
)
"""Qwen2.5-Omni's template shape with Qwen3-Omni's placeholders (the released Qwen3 template, with its tool and
thinking branches, is not available offline; the placeholders are the ones vLLM's Qwen3-Omni thinker emits)."""


def _qwen3_omni(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Qwen3-Omni-MoE as released (thinker, talker and code2wav configs nested) without audio output, so only the
    thinker is saved (`thinker.*`): its audio tower (three stride-2 convolutions over 100-frame chunks, windowed
    attention; the released n_window 50 and n_window_infer 800 kept, which vLLM and SGLang hard-code) at width 64
    and depth 2, its Qwen3-VL vision tower (patch 16, learned positions, DeepStack taps after blocks 1 and 2 of 4),
    a 4-expert top-2 MoE language model, and the processor: Whisper extractor at 128 mel bins, the Qwen2-VL image
    and video processors at patch 16 (Qwen3-VL's normalisation; the released values are not checked offline)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3OmniMoeConfig, Qwen3OmniMoeProcessor

    rope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
        "interleaved": True,
    }  # halves of 32-wide heads, Qwen3-VL's interleaved split
    text = _text(
        vocab,
        ids,
        QWEN3_OMNI,
        init_std,
        rope_parameters=rope,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    )
    thinker = dict(
        audio_config={
            "d_model": 64,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "num_mel_bins": 128,
            "max_source_positions": 1500,
            "n_window": 50,
            "n_window_infer": 800,
            "downsample_hidden_size": 8,
            "output_dim": 64,
            "initializer_range": init_std,
        },
        vision_config={
            "depth": 4,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1, 2],
            "image_size": 128,
            "apply_vit_abs_pos_embed": True,  # vLLM reads these: 8x8 positions
            "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": init_std,
        },
        text_config=text,
        audio_token_id=ids["<|audio_pad|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],  # SGLang's Qwen-VL processor reads it (the released config's)
        initializer_range=init_std,
    )
    cfg = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        enable_audio_output=False,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
    )
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    extractor = _whisper_extractor(chunk_length=300, dither=0.0)
    norm = {
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    processor = Qwen3OmniMoeProcessor(
        Qwen2VLImageProcessor(**norm), Qwen2VLVideoProcessor(**norm), extractor, tok, chat_template=QWEN3_OMNI_TEMPLATE
    )
    return cfg, processor


AUDIO_FAMILIES: dict[str, AudioFamily] = {
    # transformers 5.19 saves the language model one `model.` too deep (it reads both back alike)
    "qwen2_audio": AudioFamily(QWEN2_AUDIO, _qwen2_audio, {"language_model.model.model.": "language_model.model."}),
    "qwen2_5_omni": AudioFamily(QWEN2_5_OMNI, _qwen2_5_omni, {}),
    "qwen3_omni_moe": AudioFamily(QWEN3_OMNI, _qwen3_omni, {}),
}
"""Family name (its HF model_type) -> how to build its tiny checkpoint."""


def build_audio_checkpoint(out_dir: str | os.PathLike, family: str, seed: int = 0, init_std: float = 0.1) -> Path:
    """Write a complete random checkpoint of the audio `family` (config, safetensors, tokenizer, processor configs,
    chat template) to `out_dir`."""
    from transformers import AutoModelForMultimodalLM

    if family not in AUDIO_FAMILIES:
        raise ValueError(f"unknown audio family {family!r}; families {sorted(AUDIO_FAMILIES)}")
    return build_tiny_checkpoint(out_dir, family, AUDIO_FAMILIES[family], AutoModelForMultimodalLM, seed, init_std)


def ensure_audio_checkpoint(family: str, seed: int = 0) -> Path:
    """The cached tiny checkpoint of the audio `family`, built atomically on first use."""
    return ensure_tiny_checkpoint(family, seed, f"a{BUILDER_VERSION}", build_audio_checkpoint)
