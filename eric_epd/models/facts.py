"""What a process needs to know about a checkpoint, read from its config.json once (ModelFacts): its family, its
modalities, its rows' widths (by common/widths.py's one rule) and its dtype. Importing this module imports no torch;
the gateway and the vLLM connector never import it (they reach the width rule through wire/handoff)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

from eric_epd.common.tower_defaults import vision_config
from eric_epd.common.widths import TOWER_TYPES, embedding_width, is_generic
from eric_epd.wire.eric import GRID, MEDIA, Placement

GENERIC_TOWERS: Mapping[str, str] = MappingProxyType(
    {
        "gemma3": "eric_epd.models.gemma3",
        "internvl": "eric_epd.models.internvl",
        "qwen2_audio": "eric_epd.models.qwen2_audio",
        "qwen2_5_omni": "eric_epd.models.qwen2_5_omni",
        "qwen3_omni_moe": "eric_epd.models.qwen3_omni",
    }
)
"""Generic-path families whose worker runs a tensor-parallel tower of Eric's own in place of transformers' classes,
so --tp > 1 serves them, by the module holding it (its `ENCODER`, loaded by GenericWorkload, and its `check_tp`,
called before any process starts; see generic_tower); their processing, batching, hashing and placement stay the
generic path's."""
GENERIC_TOWER_TYPES = frozenset(GENERIC_TOWERS)
GENERIC_VIDEO_TYPES = frozenset({"llava_onevision", "glm4v", "glm4v_moe", "internvl", "gemma4"})
"""Generic-path families whose videos Eric encodes too: their video rows and vLLM's frame sampling for them
(models/hf/video.py) were checked against vLLM's model (the others' videos go to the engine with their request)."""
GENERIC_AUDIO_TYPES = frozenset({"qwen2_audio"})
"""Generic-path families whose Eric encodes audio (models/hf/audio.py): audio-only models, whose worker runs Eric's own
tower where GENERIC_TOWERS has one (Qwen2-Audio's: models/qwen2_audio.py, any TP), else transformers' audio tower and
projector at TP 1 (models/hf/audio_encoder.py)."""
GENERIC_OMNI_TYPES = frozenset({"qwen2_5_omni", "qwen3_omni_moe"})
"""Generic-path families whose Eric encodes audio, images and videos (models/hf/omni.py: the processor): the
thinker's audio tower and vision tower (its language model, talker and token2wav never built), Eric's own where
GENERIC_TOWERS has them (Qwen2.5-Omni's: models/qwen2_5_omni.py; Qwen3-Omni's: models/qwen3_omni.py; any TP), else
transformers' at TP 1 (models/hf/omni.HFOmniEncoder)."""
DTYPE_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "float32": "float32",
        "fp32": "float32",
        "float": "float32",
        "bfloat16": "bfloat16",
        "bf16": "bfloat16",
        "float16": "float16",
        "fp16": "float16",
        "half": "float16",
    }
)
"""The --dtype spellings accepted, by the dtype each names."""


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json; a process reads it once, into its ModelFacts, and hands that `config` to the
    registry's loaders. FileNotFoundError for a directory without one."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def dtype_name(setting: str, config: Mapping[str, Any]) -> str:
    """The dtype a --dtype `setting` names ("auto": the checkpoint's own dtype, float32 if it names none)."""
    if setting == "auto":
        setting = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    if setting not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {setting!r}; use auto, float32, bfloat16 or float16")
    return DTYPE_NAMES[setting]


def serves_tp(model_type: str, tp: int) -> bool:
    """Whether Eric runs this model_type's tower at --tp `tp`: any for a tower of its own (hand-written or in
    GENERIC_TOWER_TYPES), 1 only for the rest of the generic path (transformers' classes)."""
    return tp == 1 or model_type in TOWER_TYPES or model_type in GENERIC_TOWER_TYPES


def generic_tower(model_type: str) -> ModuleType:
    """The module of the tower of Eric's own serving a GENERIC_TOWERS family (imported here: it imports torch)."""
    if model_type not in GENERIC_TOWERS:
        raise ValueError(
            f"model_type {model_type!r} has no tower of Eric's own; those that do: {', '.join(sorted(GENERIC_TOWERS))}"
        )
    return importlib.import_module(GENERIC_TOWERS[model_type])


def generic_modalities(model_type: str) -> tuple[str, ...]:
    """What Eric's generic path encodes for a family: audio for GENERIC_AUDIO_TYPES, all three for
    GENERIC_OMNI_TYPES, else images, and videos where GENERIC_VIDEO_TYPES says so."""
    if model_type in GENERIC_AUDIO_TYPES:
        return ("audio",)
    if model_type in GENERIC_OMNI_TYPES:
        return ("image", "video", "audio")
    return ("image", "video") if model_type in GENERIC_VIDEO_TYPES else ("image",)


def has_audio_tower(config: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's model takes audio: its config.json (or its thinker's, in the Omni families) holds an
    audio tower's `audio_config`, whether or not Eric encodes its audio."""
    thinker = config.get("thinker_config")
    return bool(config.get("audio_config") or (isinstance(thinker, Mapping) and thinker.get("audio_config")))


@dataclass(frozen=True)
class ModelFacts:
    """One checkpoint as Eric serves it, built once per process (ModelFacts.from_checkpoint) and passed down."""

    model_dir: Path
    model_type: str
    """The HF model_type, one the registry supports."""
    modalities: tuple[str, ...]
    """What its modality processor takes ("image", "video", "audio")."""
    embedding_width: int
    """Values per image row (DeepStack levels included): see embedding_width; `width` gives any modality's."""
    merge_size: int
    """The spatial merge size: merge_size**2 patches make one output token."""
    pixel_row: int
    """Values per patch row the encoder takes (channels x temporal patch x patch^2)."""
    temporal_patch: int = 1
    """Frames per patch row (an image's one frame is repeated over them)."""
    generic: bool = False
    """Served by the generic path (the checkpoint's HF processor; transformers' own classes at TP 1, or a tower of
    Eric's for GENERIC_TOWER_TYPES); merge_size and pixel_row are then unused."""
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """config.json as read (for the registry's loaders, the fingerprint and SGLang's dtype rule); never mutated."""

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ModelFacts:
        """The facts of the checkpoint in `model_dir`: its config.json is read here, once."""
        return cls.from_config(Path(model_dir), read_config(model_dir))

    @classmethod
    def from_config(cls, model_dir: Path, config: dict[str, Any]) -> ModelFacts:
        """The facts of a config.json already read (a model_type without a hand-written tower: the generic path's);
        ValueError for a hand-written family's config without a vision tower."""
        if is_generic(config):  # whether the generic path can serve it is checked by registry.check_servable
            model_type = str(config.get("model_type", ""))
            return cls(
                model_dir,
                model_type,
                generic_modalities(model_type),
                embedding_width(config),
                1,
                0,
                generic=True,
                config=config,
            )
        model_type = str(config.get("model_type", ""))
        if "vision_config" not in config:
            raise ValueError(f"{model_dir}/config.json has no vision_config")
        vision = vision_config(model_type, config["vision_config"])  # as the tower reads it
        temporal = int(vision["temporal_patch_size"])
        row = int(vision["in_channels"]) * temporal * int(vision["patch_size"]) ** 2
        return cls(
            model_dir,
            model_type,
            TOWER_TYPES[model_type],
            embedding_width(config),
            int(vision["spatial_merge_size"]),
            row,
            temporal,
            config=config,
        )

    @property
    def placement(self) -> Placement:
        """How the engine places this model's items (wire.eric.Placement): "media" on the generic path (the
        engine's own processor computes the placeholder from the image), "grid" for a hand-written tower."""
        return MEDIA if self.generic else GRID

    @property
    def takes_audio(self) -> bool:
        """Whether the model takes audio (Eric encodes it, or the engine does: see has_audio_tower)."""
        return "audio" in self.modalities or has_audio_tower(self.config)

    def width(self, modality: str) -> int:
        """Values per output row of a `modality` item (embedding_width; that of images for a config without one)."""
        return embedding_width(self.config, modality) if self.config else self.embedding_width

    @property
    def widths(self) -> dict[str, int]:
        """The row width of each modality the model takes (see width)."""
        return {modality: self.width(modality) for modality in self.modalities}

    @property
    def merge_unit(self) -> int:
        """Patches per output token."""
        return self.merge_size**2

    def output_dtype(self, setting: str) -> str:
        """The dtype of the rows the encoder outputs ("float32", "bfloat16", ...) for a --dtype `setting` ("auto": the
        checkpoint's own); its tower may compute in another (--compute-dtype, models/compute_dtype.py)."""
        return dtype_name(setting, self.config)
