"""What a process needs to know about a checkpoint, read from its config.json once (ModelFacts), and the one rule for
the width of an embedding row (embedding_width). Importing this module imports no torch: the gateway and the vLLM
connector reach embedding_width through wire/handoff."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def embedding_width(config: Mapping[str, Any]) -> int:
    """Width of one embedding row a checkpoint's vision tower hands its language model, from its config.json (or a
    transformers config's to_dict()): the merged token's width times (1 + DeepStack levels), the rows laid out
    [merged | level 1 | ... | level k] as the engines' own encoders produce them."""
    vision = config.get("vision_config") or {}
    levels = len(vision.get("deepstack_visual_indexes") or ())
    return int(vision.get("out_hidden_size") or vision["hidden_size"]) * (1 + levels)


@dataclass(frozen=True)
class ModelFacts:
    """One checkpoint as Eric serves it, built once per process (ModelFacts.from_checkpoint) and passed down."""

    model_dir: Path
    model_type: str
    """The HF model_type, one the registry supports."""
    modalities: tuple[str, ...]
    """What its modality processor takes ("image", "video")."""
    embedding_width: int
    """Values per output row (DeepStack levels included): see embedding_width."""
    merge_size: int
    """The spatial merge size: merge_size**2 patches make one output token."""
    pixel_row: int
    """Values per patch row the encoder takes (channels x temporal patch x patch^2)."""
    config: dict[str, Any] = field(repr=False, compare=False)
    """config.json as read (for the registry's loaders, the fingerprint and SGLang's dtype rule); never mutated."""

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ModelFacts:
        """The facts of the checkpoint in `model_dir`: its config.json is read here, once."""
        from eric_epd.models.registry import read_model_config

        return cls.from_config(Path(model_dir), read_model_config(model_dir))

    @classmethod
    def from_config(cls, model_dir: Path, config: dict[str, Any]) -> ModelFacts:
        """The facts of a config.json already read; ValueError for a model_type the registry does not support or a
        config without a vision tower."""
        from eric_epd.models.registry import get_model_spec

        spec = get_model_spec(config.get("model_type", ""))
        if "vision_config" not in config:
            raise ValueError(f"{model_dir}/config.json has no vision_config")
        vision = config["vision_config"]
        row = (vision.get("in_chans", vision.get("in_channels", 3)) * vision.get("temporal_patch_size", 2)
               * vision.get("patch_size", 14) ** 2)
        return cls(model_dir, spec.model_type, spec.processor_cls.modalities, embedding_width(config),
                   int(vision.get("spatial_merge_size", 2)), row, config)

    @property
    def merge_unit(self) -> int:
        """Patches per output token."""
        return self.merge_size**2

    def output_dtype(self, setting: str) -> str:
        """The dtype the encoder computes and outputs in ("float32", "bfloat16", ...) for a --dtype `setting`
        ("auto": the checkpoint's own)."""
        from eric_epd.models.registry import resolve_dtype

        return str(resolve_dtype(setting, self.config)).removeprefix("torch.")
