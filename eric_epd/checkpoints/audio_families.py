"""Offline builders of tiny random checkpoints for the audio families Eric serves (Qwen2-Audio, Qwen2.5-Omni's
thinker), saved like a Hugging Face repo: random weights, a locally trained tokenizer carrying the family's special
tokens, the family's own processor classes (its Whisper feature extractor at the released settings) and the family's
chat template.

Nothing is downloaded; deterministic by seed. The audio towers keep the released input geometry (128 mel bins, 1500
positions) and shrink only their width and depth; the text side is the one every tiny family shares (heads of 32,
which vLLM's CPU attention takes)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eric_epd.checkpoints.builtin import ensure_built
from eric_epd.checkpoints.saving import save_random_checkpoint
from eric_epd.checkpoints.text_parts import Tokens, _text

logger = logging.getLogger(__name__)

BUILDER_VERSION = 2  # bump when the output of build_audio_checkpoint changes


@dataclass(frozen=True)
class AudioFamily:
    """How to build one audio family: its tokens and a maker of (model config, processor with chat template)."""

    tokens: Tokens
    make: Callable[[Any, dict[str, int], int, float], tuple[Any, Any]]
    """(tokenizer, token ids, vocab size, init std) -> (model config, processor)."""
    released: dict[str, str]
    """Saved tensor-name prefixes renamed to those of the family's released checkpoints (what vLLM reads)."""


QWEN2_AUDIO = Tokens(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"),
                     eos="<|im_end|>")
"""Qwen2-Audio's special tokens; its processor finds the audio ones by their default names."""


def _qwen2_audio(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Qwen2-Audio's Whisper-style tower at width 64 and depth 2 over the released input (128 mel bins, 1500
    positions: 30 s), its linear projector, and its processor with the released feature-extractor settings and chat
    template (transformers keeps the released template as the processor's default)."""
    from transformers import Qwen2AudioConfig, Qwen2AudioProcessor, WhisperFeatureExtractor

    cfg = Qwen2AudioConfig(
        audio_config={"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
                      "num_mel_bins": 128, "max_source_positions": 1500, "initializer_range": init_std},
        text_config={"model_type": "qwen2", **_text(vocab, ids, QWEN2_AUDIO, init_std)},
        audio_token_index=ids["<|AUDIO|>"])
    cfg.architectures = ["Qwen2AudioForConditionalGeneration"]
    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30,
                                        n_fft=400, padding_value=0.0, return_attention_mask=True)
    processor = Qwen2AudioProcessor(extractor, tok)
    processor.chat_template = processor.default_chat_template
    return cfg, processor


QWEN2_5_OMNI = Tokens(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                       "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>"),
                      {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                       "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                       "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}, eos="<|im_end|>")
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
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}  # halves of 32-wide heads
    thinker = dict(
        audio_config={"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
                      "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100, "output_dim": 64,
                      "initializer_range": init_std},
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [1], "hidden_act": "silu", "initializer_range": init_std},
        text_config=_text(vocab, ids, QWEN2_5_OMNI, init_std, rope_parameters=rope),
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        initializer_range=init_std)
    cfg = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)  # saved as its model class, which
    # vLLM 0.32 maps to its thinker as it maps the released `Qwen2_5OmniModel`
    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300,
                                        n_fft=400, padding_value=0.0, return_attention_mask=True, dither=0.0)
    processor = Qwen2_5OmniProcessor(Qwen2VLImageProcessor(), Qwen2VLVideoProcessor(), extractor, tok,
                                     chat_template=QWEN2_5_OMNI_TEMPLATE)
    return cfg, processor


AUDIO_FAMILIES: dict[str, AudioFamily] = {
    # transformers 5.19 saves the language model one `model.` too deep (it reads both back alike)
    "qwen2_audio": AudioFamily(QWEN2_AUDIO, _qwen2_audio, {"language_model.model.model.": "language_model.model."}),
    "qwen2_5_omni": AudioFamily(QWEN2_5_OMNI, _qwen2_5_omni, {}),
}
"""Family name (its HF model_type) -> how to build its tiny checkpoint."""


def build_audio_checkpoint(out_dir: str | os.PathLike, family: str, seed: int = 0, init_std: float = 0.1) -> Path:
    """Write a complete random checkpoint of the audio `family` (config, safetensors, tokenizer, processor configs,
    chat template) to `out_dir`."""
    from transformers import AutoModelForMultimodalLM

    if family not in AUDIO_FAMILIES:
        raise ValueError(f"unknown audio family {family!r}; families {sorted(AUDIO_FAMILIES)}")
    spec = AUDIO_FAMILIES[family]
    out = Path(out_dir)
    model = save_random_checkpoint(out, spec.tokens, spec.make, AutoModelForMultimodalLM, spec.released, seed, init_std)
    logger.info("built %s checkpoint at %s: %.2fM params", family, out,
                sum(p.numel() for p in model.parameters()) / 1e6)
    return out


def ensure_audio_checkpoint(family: str, seed: int = 0) -> Path:
    """The cached tiny checkpoint of the audio `family`, built atomically on first use."""
    return ensure_built(f"{family}-tiny-s{seed}-a{BUILDER_VERSION}", "config.json",
                        lambda out: build_audio_checkpoint(out, family, seed))
