"""`--model` as vLLM takes it: a local checkpoint directory or a Hugging Face repo id (with `--revision`), resolved
through huggingface_hub's cache (HF_HUB_OFFLINE respected), fetching only the configs and the encoder's shards."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

SMALL_FILES = [
    "config.json",
    "*preprocessor_config.json",
    "processor_config.json",
    "chat_template*",
    "tokenizer*",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "*.safetensors.index.json",
]
"""What Eric reads besides weights: configs, the processor's files and the shard index."""
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(model: str) -> bool:
    """Whether `--model` reads as a Hugging Face repo id (owner/name, no `..`) rather than a local path."""
    return bool(_REPO_ID.match(model)) and ".." not in model


def encoder_shards(snapshot: Path, prefixes: tuple[str, ...]) -> list[str] | None:
    """Shard files holding tensors under `prefixes` (from the safetensors index); None without an index."""
    index = snapshot / "model.safetensors.index.json"
    if not index.exists():
        return None
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    return sorted({file for name, file in weight_map.items() if name.startswith(prefixes)})


def resolve_model(model: str, revision: str | None = None) -> Path:
    """A local directory as is; a repo id downloaded (or found in the cache) with only the encoder's shards."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if not is_repo_id(model):
        raise ValueError(f"--model {model!r} is neither a checkpoint directory nor a Hugging Face repo id (org/name)")
    from huggingface_hub import snapshot_download

    from eric_epd.models.registry import get_model_spec, is_generic, read_model_config

    snapshot = Path(snapshot_download(model, revision=revision, allow_patterns=SMALL_FILES))
    config = read_model_config(snapshot)
    if is_generic(config):
        from eric_epd.models.hf.loader import vision_shards

        shards = vision_shards(snapshot)
    else:
        shards = encoder_shards(snapshot, get_model_spec(config.get("model_type", "")).weight_prefixes)
    weights = shards if shards is not None else ["*.safetensors"]
    logger.info("%s@%s: fetching %s", model, revision or "main", ", ".join(weights))
    return Path(snapshot_download(model, revision=revision, allow_patterns=[*SMALL_FILES, *weights]))
