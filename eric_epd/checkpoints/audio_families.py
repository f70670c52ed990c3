"""Offline builders of tiny random checkpoints for the audio families Eric serves (Qwen2-Audio), saved like a Hugging
Face repo: random weights, a locally trained tokenizer carrying the family's special tokens, the family's own
processor classes (its Whisper feature extractor at the released settings) and the family's chat template.

Nothing is downloaded; deterministic by seed. The audio tower keeps the released input geometry (128 mel bins, 30 s
padded to 3000 frames, 1500 positions) and shrinks only its width and depth; the text side is the one every tiny
family shares (heads of 32, which vLLM's CPU attention takes)."""

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


AUDIO_FAMILIES: dict[str, AudioFamily] = {
    # transformers 5.19 saves the language model one `model.` too deep (it reads both back alike)
    "qwen2_audio": AudioFamily(QWEN2_AUDIO, _qwen2_audio, {"language_model.model.model.": "language_model.model."}),
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
