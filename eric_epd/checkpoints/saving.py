"""Saving a tiny family checkpoint: the random model, tokenizer, processor and generation config written like a hub
repo, constant parameters jittered, tensors renamed to the released checkpoints' names, the chat template also in
tokenizer_config.json; and the build-then-cache step every tiny family's builder takes."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from eric_epd.checkpoints.builtin import ensure_built
from eric_epd.checkpoints.text_parts import Tokens, build_tokenizer

logger = logging.getLogger(__name__)


def jitter_constants(model: torch.nn.Module, std: float) -> None:
    """Parameters transformers initialises to one constant (zero projections such as Gemma 3's, unit norms, zero
    biases) get random values around it: a test then sees every weight matter."""
    with torch.no_grad():
        for param in model.parameters():
            flat = param.reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                param.add_(torch.randn_like(param) * std)


def rename_tensors(path: Path, prefixes: dict[str, str]) -> None:
    """Rename the saved tensors whose names start with a key of `prefixes` (one file: the checkpoints are tiny)."""
    if not prefixes:
        return
    from safetensors.torch import load_file, save_file

    def renamed(name: str) -> str:
        old = next((p for p in prefixes if name.startswith(p)), None)
        return name if old is None else prefixes[old] + name[len(old) :]

    save_file({renamed(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})


def with_chat_template(out: Path, template: str) -> None:
    """The chat template also in tokenizer_config.json, where vLLM's tokenizer-only paths look for it."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


def save_random_checkpoint(
    out: Path,
    tokens: Tokens,
    make: Callable[[Any, dict[str, int], int, float], tuple[Any, Any]],
    auto_class: Any,
    released: dict[str, str],
    seed: int,
    init_std: float,
    chat_template: str | None = None,
) -> torch.nn.Module:
    """Write a random checkpoint to `out`: a tokenizer trained on `tokens`, the config and processor `make` gives
    (tokenizer, token ids, vocab size, init std), an `auto_class` model of that config (float32, constants jittered,
    tensors renamed by `released`), its generation config, and the processor with `chat_template` (default: the
    processor's own) also in tokenizer_config.json. Returns the model."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tokens)
    ids = {t: tok.convert_tokens_to_ids(t) for t in tokens.specials}
    vocab = ((len(tok) + 63) // 64) * 64
    cfg, processor = make(tok, ids, vocab, init_std)
    cfg.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = auto_class.from_config(cfg).to(torch.float32).eval()
    jitter_constants(model, init_std)
    model.save_pretrained(out, safe_serialization=True)
    rename_tensors(out / "model.safetensors", released)
    GenerationConfig(eos_token_id=ids[tokens.eos], pad_token_id=ids[tokens.pad], do_sample=False).save_pretrained(out)
    if chat_template is not None:
        processor.chat_template = chat_template
    processor.save_pretrained(out)
    with_chat_template(out, processor.chat_template)
    return model


class TinyFamily(Protocol):
    """How to build one tiny family (checkpoints/families.Family, audio_families.AudioFamily)."""

    @property
    def tokens(self) -> Tokens:
        """Its special tokens."""

    @property
    def make(self) -> Callable[[Any, dict[str, int], int, float], tuple[Any, Any]]:
        """(tokenizer, token ids, vocab size, init std) -> (model config, processor)."""

    @property
    def released(self) -> dict[str, str]:
        """Saved tensor-name prefixes renamed to those of the family's released checkpoints."""

    @property
    def chat_template(self) -> str | None:
        """The chat template saved with the processor (None: the processor's own)."""

    @property
    def finish(self) -> Callable[[Path, Any], None] | None:
        """(checkpoint dir, model) -> None: the family's last touches to what was saved, if any."""


def build_tiny_checkpoint(
    out_dir: str | os.PathLike, family: str, spec: TinyFamily, auto_class: Any, seed: int, init_std: float
) -> Path:
    """Write the random checkpoint `spec` describes (save_random_checkpoint with an `auto_class` model, then the
    family's `finish`) to `out_dir`; returns it."""
    out = Path(out_dir)
    model = save_random_checkpoint(
        out, spec.tokens, spec.make, auto_class, spec.released, seed, init_std, spec.chat_template
    )
    if spec.finish is not None:
        spec.finish(out, model)
    logger.info(
        "built %s checkpoint at %s: %.2fM params", family, out, sum(p.numel() for p in model.parameters()) / 1e6
    )
    return out


def ensure_tiny_checkpoint(
    family: str, seed: int, version: str, build: Callable[[str | os.PathLike, str, int], Path]
) -> Path:
    """The cached tiny checkpoint of `family` (cache directory `<family>-tiny-s<seed>-<version>`), built atomically
    by `build(out_dir, family, seed)` on first use."""
    return ensure_built(f"{family}-tiny-s{seed}-{version}", "config.json", lambda out: build(out, family, seed))
