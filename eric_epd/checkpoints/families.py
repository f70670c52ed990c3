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
from eric_epd.checkpoints.native_families import GEMMA4, GLM4V, MISTRAL3, make_gemma4, make_glm4v, make_mistral3
from eric_epd.checkpoints.saving import build_tiny_checkpoint, ensure_tiny_checkpoint
from eric_epd.checkpoints.text_parts import Tokens, _template, _text
from eric_epd.checkpoints.tiled_families import (
    GEMMA3,
    IDEFICS3,
    INTERNVL,
    LLAMA4,
    QWEN_CHAT,
    RELEASED_SIGLIP,
    make_gemma3,
    make_idefics3,
    make_internvl,
    make_llama4,
    make_llava_onevision,
    make_smolvlm,
)

BUILDER_VERSION = 6  # bump when the output of build_family_checkpoint changes


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
        make_gemma3,
        RELEASED_SIGLIP,
    ),
    "internvl": Family(
        INTERNVL,
        _template(
            "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n", "<IMG_CONTEXT>\n", video="<video>\n"
        ),
        make_internvl,
    ),
    "llava_onevision": Family(
        QWEN_CHAT,
        _template("<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n", "<image>\n", video="<video>\n"),
        make_llava_onevision,
        RELEASED_SIGLIP,
    ),
    "mistral3": Family(MISTRAL3, _template("[INST]", "", "[/INST]", "[IMG]", "{{ bos_token }}"), make_mistral3),
    "glm4v": Family(GLM4V, FAMILY_GLM_TEMPLATE, make_glm4v),
    "glm4v_moe": Family(GLM4V, FAMILY_GLM_TEMPLATE, functools.partial(make_glm4v, moe=True)),
    "idefics3": Family(
        IDEFICS3, _template("User:", "Assistant:", "<end_of_utterance>\n", "<image>", "<|im_start|>"), make_idefics3
    ),
    "smolvlm": Family(
        IDEFICS3, _template("User:", "Assistant:", "<end_of_utterance>\n", "<image>", "<|im_start|>"), make_smolvlm
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
        make_gemma4,
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
        make_llama4,
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
