"""Touches a tiny family checkpoint gets after transformers saved it: constant parameters jittered, tensors renamed to
the released checkpoints' names, the chat template also in tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch


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
        return name if old is None else prefixes[old] + name[len(old):]

    save_file({renamed(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})


def with_chat_template(out: Path, template: str) -> None:
    """The chat template also in tokenizer_config.json, where vLLM's tokenizer-only paths look for it."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))
