"""Registry of supported checkpoints by HF `model_type`, and loaders that build only the vision tower and
stream only its tensors (this rank's shard) out of the checkpoint's safetensors files."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from eric_epd.common.widths import TOWER_TYPES, is_generic
from eric_epd.models.facts import dtype_name, read_config
from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.processor import BaseModalityProcessor
from eric_epd.models.qwen2_5_vl import Qwen2_5_VLVisionEncoder
from eric_epd.models.qwen2_vl import VISION_PREFIXES, Qwen2VLVisionEncoder
from eric_epd.models.qwen2_vl_processor import Qwen2_5_VLModalityProcessor, Qwen2VLModalityProcessor
from eric_epd.models.qwen3_vl import Qwen3_5VisionEncoder, Qwen3VLVisionEncoder
from eric_epd.models.qwen3_vl_processor import Qwen3VLModalityProcessor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What Eric needs to serve one model family."""

    model_type: str
    encoder_cls: type[nn.Module]
    processor_cls: type[BaseModalityProcessor]
    weight_prefixes: tuple[str, ...]


MODEL_SPECS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        spec.model_type: spec
        for spec in (
            ModelSpec("qwen2_vl", Qwen2VLVisionEncoder, Qwen2VLModalityProcessor, VISION_PREFIXES),
            ModelSpec("qwen2_5_vl", Qwen2_5_VLVisionEncoder, Qwen2_5_VLModalityProcessor, VISION_PREFIXES),
            ModelSpec("qwen3_vl", Qwen3VLVisionEncoder, Qwen3VLModalityProcessor, VISION_PREFIXES),
            ModelSpec("qwen3_vl_moe", Qwen3VLVisionEncoder, Qwen3VLModalityProcessor, VISION_PREFIXES),
            ModelSpec("qwen3_5", Qwen3_5VisionEncoder, Qwen3VLModalityProcessor, VISION_PREFIXES),  # no DeepStack
            ModelSpec("qwen3_5_moe", Qwen3_5VisionEncoder, Qwen3VLModalityProcessor, VISION_PREFIXES),
        )
    }
)

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
)


assert set(MODEL_SPECS) == set(TOWER_TYPES), "widths.TOWER_TYPES must name exactly the hand-written towers"


def check_servable(model_dir: str | Path) -> None:
    """ValueError naming the supported families and what the generic path needs, unless Eric can serve `model_dir`."""
    if is_generic(read_model_config(Path(model_dir))):
        from eric_epd.models.hf.loader import check_generic

        check_generic(model_dir, MODEL_SPECS)


def get_model_spec(model_type: str) -> ModelSpec:
    """The spec for an HF model_type; ValueError naming the supported types otherwise."""
    try:
        return MODEL_SPECS[model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r}; Eric supports {sorted(MODEL_SPECS)}") from None


read_model_config = read_config
"""A checkpoint's config.json (models/facts.py reads it; a process does so once, into its ModelFacts)."""


def resolve_dtype(name: str | torch.dtype, config: Mapping[str, Any]) -> torch.dtype:
    """ "auto" -> the checkpoint's dtype / torch_dtype (float32 if absent); otherwise the named dtype."""
    if isinstance(name, torch.dtype):
        return name
    return DTYPES[dtype_name(name, config)]


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_vision_tensors(model_dir: str | Path, prefixes: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """(name, safetensors slice) for every tensor whose name starts with a vision prefix; slices are read
    lazily (only the requested rows/columns), and no other tensor is ever read."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    wanted: dict[str, list[str]] | None = None
    if index.exists():
        wanted = {}
        for name, fname in json.loads(index.read_text())["weight_map"].items():
            if name.startswith(prefixes):
                wanted.setdefault(fname, []).append(name)
    files = [model_dir / f for f in sorted(wanted)] if wanted is not None else _safetensors_files(model_dir)
    for path in files:  # with an index, files holding only language-model tensors are never opened
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = (
                wanted[path.name] if wanted is not None else [k for k in f.keys() if k.startswith(prefixes)]  # noqa: SIM118
            )
            for name in names:
                yield name, f.get_slice(name)


def vision_weights_digest(model_dir: str | Path, config: Mapping[str, Any] | None = None) -> str:
    """blake2b over every vision tensor's name, dtype, shape and bytes (language-model tensors are never read): two
    checkpoints share it only if their towers compute the same function. About a second per GB of tower. `config`:
    its config.json if already read (here and below)."""
    import hashlib

    config = read_model_config(model_dir) if config is None else config
    if is_generic(config):
        from eric_epd.models.hf.loader import vision_digest

        return vision_digest(model_dir)
    spec = get_model_spec(config.get("model_type", ""))
    digest = hashlib.blake2b(digest_size=16)
    for name, part in sorted(iter_vision_tensors(model_dir, spec.weight_prefixes), key=lambda kv: kv[0]):
        tensor = part[:] if part.get_shape() else part[()]  # the whole tensor out of the file
        digest.update(f"{name}|{part.get_dtype()}|{list(part.get_shape())}\0".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def build_encoder(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPContext | None = None,
    config: Mapping[str, Any] | None = None,
) -> nn.Module:
    """The vision encoder of a checkpoint, parameters allocated (uninitialised) on `device`; no weights."""
    config = read_model_config(model_dir) if config is None else config
    spec = get_model_spec(config.get("model_type", ""))
    if "vision_config" not in config:
        raise ValueError(f"{model_dir}/config.json has no vision_config")
    with torch.device("meta"):
        encoder = spec.encoder_cls(config["vision_config"], tp or TPContext(), dtype)
    return encoder.to_empty(device=torch.device(device)).eval()


def load_encoder(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPContext | None = None,
    config: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Build the vision tower of `model_dir` on `device` in `dtype` and load this rank's shard of its weights.

    The language model is never built and its tensors are never read."""
    model_dir = Path(model_dir)
    config = read_model_config(model_dir) if config is None else config
    spec = get_model_spec(config.get("model_type", ""))
    encoder = build_encoder(model_dir, dtype, device, tp, config)
    loaded = encoder.load_weights(iter_vision_tensors(model_dir, spec.weight_prefixes))
    n_params = sum(p.numel() for p in encoder.parameters())
    tp = tp or TPContext()
    logger.info(
        "loaded %s vision encoder from %s: %d tensors, %.1fM params/rank, %s on %s, tp %d/%d",
        spec.model_type,
        model_dir,
        len(loaded),
        n_params / 1e6,
        dtype,
        device,
        tp.rank,
        tp.world_size,
    )
    return encoder


def load_processor(model_dir: str | Path, config: Mapping[str, Any] | None = None) -> BaseModalityProcessor:
    """The modality processor for a checkpoint directory."""
    config = read_model_config(model_dir) if config is None else config
    if is_generic(dict(config)):
        from eric_epd.models.facts import GENERIC_AUDIO_TYPES, GENERIC_OMNI_TYPES

        check_servable(model_dir)
        if config.get("model_type") in GENERIC_AUDIO_TYPES:
            from eric_epd.models.hf.audio import HFAudioProcessor

            return HFAudioProcessor(Path(model_dir))
        if config.get("model_type") in GENERIC_OMNI_TYPES:
            from eric_epd.models.hf.omni import HFOmniProcessor

            return HFOmniProcessor(Path(model_dir))
        from eric_epd.models.hf.processor import HFImageProcessor

        return HFImageProcessor(Path(model_dir))
    return get_model_spec(config.get("model_type", "")).processor_cls(Path(model_dir))
