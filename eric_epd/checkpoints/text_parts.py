"""The language side every tiny family checkpoint shares: the tiny text model's settings, the family's special
tokens, a locally trained tokenizer carrying them, and chat templates in the family's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eric_epd.checkpoints.builtin import _CORPUS

TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
"""The tiny language model every family shares: heads of 32 (vLLM's CPU attention takes 32 and up)."""


@dataclass(frozen=True)
class Tokens:
    """A family's special tokens: all of them, and those the processor reads by name (`tokenizer.<name>`)."""

    specials: tuple[str, ...]
    named: dict[str, str] = field(default_factory=dict)
    bos: str | None = None
    eos: str = "<|endoftext|>"
    pad: str = "<|endoftext|>"
    plain: tuple[str, ...] = ()
    """Ordinary tokens the family's vocabulary holds whole, which vLLM looks up by their text (Gemma's newlines)."""


NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
"""Gemma's vocabulary has runs of newlines as tokens; vLLM's Gemma 3 reads their ids."""


def _template(user: str, assistant: str, end: str, image: str, bos: str = "", video: str = "") -> str:
    """A chat template in the family's shape: `user`/`assistant` open a turn, `end` closes it, `image` stands for an
    image part and `video` for a video part (none: the family's template has no videos)."""
    videos = f"{{% elif content['type'] in ('video', 'video_url') %}}{video}" if video else ""
    return (
        f"{bos}{{% for message in messages %}}"
        f"{{% if message['role'] == 'user' %}}{user}{{% else %}}{assistant}{{% endif %}}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for content in message['content'] %}"
        f"{{% if content['type'] in ('image', 'image_url') %}}{image}{videos}"
        "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
        f"{end}{{% endfor %}}{{% if add_generation_prompt %}}{assistant}{{% endif %}}"
    )


def build_tokenizer(tokens: Tokens, vocab_size: int = 512):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer trained offline, with `tokens`' specials (the named ones readable as attributes,
    as the family's processor expects)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(tokens.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    named = set(tokens.named.values()) | {tokens.eos, tokens.pad, tokens.bos}
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tokens.bos,
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        unk_token=None,
        extra_special_tokens=dict(tokens.named),
        additional_special_tokens=[t for t in tokens.specials if t not in named],
    )
    hf_tok.add_tokens(list(tokens.plain))
    return hf_tok


def _text(vocab: int, ids: dict[str, int], tokens: Tokens, init_std: float, **extra: Any) -> dict[str, Any]:
    return {
        **TEXT,
        "vocab_size": vocab,
        "initializer_range": init_std,
        "eos_token_id": ids[tokens.eos],
        "pad_token_id": ids[tokens.pad],
        **({"bos_token_id": ids[tokens.bos]} if tokens.bos else {}),
        **extra,
    }
