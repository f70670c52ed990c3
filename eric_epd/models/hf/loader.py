"""The vision half of a transformers image-text-to-text model: its class with the language model removed, loaded by
`from_pretrained` (so transformers' own key renames and conversions apply), and a digest of the tensors it reads."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eric_epd.models.facts import GENERIC_AUDIO_TYPES, GENERIC_OMNI_TYPES
from eric_epd.models.hf.adapters import LAYOUTS

logger = logging.getLogger(__name__)

TEXT_PARTS = ("language_model", "text_model", "lm_head")
"""The language model under its family's name and the output head: never built on Eric's side."""
LANGUAGE_PARTS = (*TEXT_PARTS, "audio_tower", "embed_audio")
"""Submodules the vision-only model replaces with empty modules (on the model and on its inner `.model`): the
language model, the output head, and an audio encoder (an image model's Eric serves images and videos)."""


THINKER_PARTS = ("model", "lm_head")
"""An Omni thinker's language model (its `model`) and output head; its audio tower and vision tower stay."""


def dropped_parts(config: Any) -> tuple[str, ...]:
    """What the encoder-only model of `config` replaces with empty modules: TEXT_PARTS for an audio family
    (facts.GENERIC_AUDIO_TYPES: its audio tower stays), THINKER_PARTS for an Omni family (facts.GENERIC_OMNI_TYPES),
    LANGUAGE_PARTS otherwise."""
    if config.model_type in GENERIC_OMNI_TYPES:
        return THINKER_PARTS
    return TEXT_PARTS if config.model_type in GENERIC_AUDIO_TYPES else LANGUAGE_PARTS


def thinker(config: Any) -> Any:
    """The config of the model Eric loads from `config`: an Omni checkpoint's thinker (the multimodal language model;
    its talker and token2wav make speech, which Eric never serves), any other checkpoint's own config."""
    return getattr(config, "thinker_config", None) or config


def hf_config(model_dir: str | Path) -> Any:
    """The checkpoint's transformers config (read from config.json, nothing downloaded)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def model_class(config: Any) -> type[nn.Module] | None:
    """The transformers image-text-to-text class of `config` (for an audio family, facts.GENERIC_AUDIO_TYPES, its
    multimodal-LM class; for an Omni family its thinker's class), or None when transformers has none."""
    from transformers import AutoModelForImageTextToText, AutoModelForMultimodalLM

    auto = AutoModelForMultimodalLM if config.model_type in GENERIC_AUDIO_TYPES else AutoModelForImageTextToText
    try:
        return auto._model_mapping[type(thinker(config))]
    except KeyError:
        return None


def vision_only_class(base: type[nn.Module], drop: tuple[str, ...] = LANGUAGE_PARTS) -> type[nn.Module]:
    """`base` whose `drop` parts (language model, output head, and an image model's audio tower) are empty modules:
    built by `from_pretrained`, their checkpoint tensors are reported unexpected and never read (transformers opens
    shards lazily and reads only the tensors the model has)."""

    class VisionOnly(base):  # type: ignore[misc, valid-type]
        _tied_weights_keys: dict[str, str] = {}  # the output head is gone: nothing to tie

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            for owner in (self, getattr(self, "model", None)):
                for name in drop:
                    if isinstance(getattr(owner, name, None), nn.Module):
                        setattr(owner, name, nn.Module())

    VisionOnly.__name__ = VisionOnly.__qualname__ = base.__name__
    return VisionOnly


def load_vision_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The checkpoint's vision (for an audio family: audio) tower and projector on `device` in `dtype`, eval mode; the
    language model is never built and its tensors are never read."""
    from transformers.utils import logging as hf_logging

    config = hf_config(model_dir)
    bars = hf_logging.is_progress_bar_enabled()
    base = model_class(config)
    if base is None:
        raise ValueError(f"transformers has no image-text-to-text class for model_type {config.model_type!r}")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists every language-model tensor as unexpected
    hf_logging.disable_progress_bar()
    try:
        with _present_shards(Path(model_dir)) as loadable:
            model, info = vision_only_class(base, dropped_parts(config)).from_pretrained(
                str(loadable), config=thinker(config), dtype=dtype, local_files_only=True, output_loading_info=True
            )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if info.get("missing_keys"):
        raise ValueError(f"{model_dir}: vision tensors missing from the checkpoint: {sorted(info['missing_keys'])[:8]}")
    model = model.to(device)  # loaded on the host first: a device_map needs accelerate
    logger.info(
        "loaded %s tower and projector from %s: %.1fM params, %s on %s",
        base.__name__,
        model_dir,
        sum(p.numel() for p in model.parameters()) / 1e6,
        dtype,
        device,
    )
    return model.eval()


@contextlib.contextmanager
def _present_shards(model_dir: Path) -> Iterator[Path]:
    """`model_dir`, or, when its index names shards that are absent (models/hub.py fetches only the vision-only
    model's shards), a temporary view of it whose index lists only the present ones: transformers opens every shard
    an index names."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        yield model_dir
        return
    data = json.loads(index.read_text())
    present = {name: file for name, file in data["weight_map"].items() if (model_dir / file).exists()}
    if len(present) == len(data["weight_map"]):
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="eric-vision-") as tmp:
        view = Path(tmp)
        for path in model_dir.iterdir():
            if path.name != index.name:
                (view / path.name).symlink_to(path.resolve())
        (view / index.name).write_text(json.dumps({**data, "weight_map": present}))
        yield view


def vision_tensor_names(model_dir: str | Path) -> dict[str, list[str]]:
    """Shard file -> the checkpoint tensors the vision-only model loads from it, found as `from_pretrained` finds
    them (the model's conversion mapping renames each checkpoint name; those landing in the model are read), with the
    model built on the meta device (nothing allocated, nothing read)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    config = hf_config(model_dir)
    base = model_class(config)
    if base is None:
        raise ValueError(f"transformers has no image-text-to-text class for model_type {config.model_type!r}")
    with torch.device("meta"):
        model = vision_only_class(base, dropped_parts(config))(thinker(config))
    wanted = model.state_dict()
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    found: dict[str, list[str]] = {}
    hit: set[str] = set()
    for shard, names in _checkpoint_names(Path(model_dir)).items():
        for name in names:
            renamed, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, wanted)
            if renamed not in wanted and name in wanted:  # as transformers: the name as is, maybe re-prefixed
                renamed, pattern = rename_source_key(name, [], [], model.base_model_prefix, wanted)
            if renamed in wanted:
                found.setdefault(shard, []).append(name)
                hit.update(_split_targets(renamed, pattern, converters))
    persistent = {k for k in wanted if not _is_buffer(model, k)}
    if persistent - hit:
        raise ValueError(f"{model_dir}: no checkpoint tensor found for {sorted(persistent - hit)[:8]}")
    return found


def _split_targets(renamed: str, pattern: str | None, converters: list) -> list[str]:
    """The model tensors one checkpoint tensor becomes: `renamed`, and where a converter splits it (Kimi-K2.5's fused
    `wqkv` into q, k and v; transformers names only the first target) the other targets too."""
    for converter in converters:
        targets = converter.target_patterns
        if pattern in converter.source_patterns and len(targets) > 1 and targets[0] in renamed:
            return [renamed.replace(targets[0], target) for target in targets]
    return [renamed]


def _is_buffer(model: nn.Module, name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf in dict(model.get_submodule(module).named_buffers(recurse=False))


def _checkpoint_names(model_dir: Path) -> dict[str, list[str]]:
    """Shard file -> tensor names, from the safetensors index or the files' headers."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        by_file: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            by_file.setdefault(file, []).append(name)
        return by_file
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = list(f.keys())
    return out


def vision_digest(model_dir: str | Path) -> str:
    """blake2b over the model's configuration (all but the language model's) and every tensor the vision-only model
    reads (name, dtype, shape, bytes): two checkpoints share it only if their towers and projectors compute the same
    function."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(_tower_config(config), sort_keys=True).encode())
    shard_of = {name: shard for shard, names in vision_tensor_names(model_dir).items() for name in names}
    with contextlib.ExitStack() as files:
        opened = {
            shard: files.enter_context(safe_open(str(model_dir / shard), framework="pt"))
            for shard in set(shard_of.values())
        }
        for name in sorted(shard_of):  # by name: however the checkpoint is sharded
            part = opened[shard_of[name]].get_slice(name)
            tensor = part[:] if part.get_shape() else part[()]
            digest.update(f"{name}|{part.get_dtype()}|{list(part.get_shape())}\0".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _tower_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json without what configures no tower: the language model's `text_config` (an Omni checkpoint's
    thinker's too) and an Omni checkpoint's talker and token2wav (Qwen3-Omni: code2wav)."""
    out = {
        k: v
        for k, v in config.items()
        if k not in ("text_config", "talker_config", "token2wav_config", "code2wav_config")
    }
    if isinstance(out.get("thinker_config"), dict):
        out["thinker_config"] = _tower_config(out["thinker_config"])
    return out


def vision_shards(model_dir: str | Path) -> list[str] | None:
    """The shard files holding the vision-only model's tensors, from the checkpoint's safetensors index (only the
    configs and the index need be present); None without an index (one file holds everything)."""
    if not (Path(model_dir) / "model.safetensors.index.json").exists():
        return None
    return sorted(vision_tensor_names(model_dir))


def check_generic(model_dir: str | Path, hand_written: Iterable[str]) -> None:
    """ValueError unless the generic path can serve `model_dir`, saying what it needs and which families Eric serves:
    a config transformers reads, an image-text-to-text class for it, and the checkpoint's processor files."""
    import transformers

    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    served = (
        f"Eric serves {sorted(hand_written)} with hand-written towers, and any image-text-to-text checkpoint "
        f"transformers {transformers.__version__} supports through its generic path (families whose row layout "
        f"was read from vLLM's model: {sorted(LAYOUTS)})"
    )
    try:
        config = hf_config(model_dir)
    except (ValueError, KeyError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"unsupported model_type {model_type!r}: transformers cannot read its config ({reason}); {served}"
        ) from None
    if model_class(config) is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}: transformers has no AutoModelForImageTextToText "
            f"class for it; {served}"
        )
    if not any((Path(model_dir) / name).exists() for name in ("processor_config.json", "preprocessor_config.json")):
        raise ValueError(
            f"unsupported model_type {model_type!r} checkpoint: {model_dir} has no processor_config.json "
            f"or preprocessor_config.json, and the generic path runs the checkpoint's own HF processor; "
            f"{served}"
        )
