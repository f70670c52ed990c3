"""What the generic path's towers of Eric's own share: loading by rank shards (separate q, k, v checkpoint tensors
into a fused qkv; models/qwen2_audio.py's and models/qwen2_5_omni.py's too), and for the image towers
(models/gemma3.py, models/internvl.py) square crops of one size in, rows out, behind the encoder interface."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Self, TypeVar

import torch
from torch import nn

from eric_epd.models.facts import read_config
from eric_epd.models.layers.parallel import TPContext, default_weight_loader

logger = logging.getLogger(__name__)

QKV_PARTS: Mapping[str, int] = MappingProxyType({"q_proj": 0, "k_proj": 1, "v_proj": 2})
"""The checkpoint's separate projections, by their place in a fused qkv."""

TowerT = TypeVar("TowerT", bound="ShardedTower")


class ShardedTower(nn.Module):
    """A tower and projector of Eric's own, this rank's shard of it, loaded from a checkpoint's tower tensors only.
    A subclass builds its modules (`__init__(config, tp, dtype)`), sets the attributes below and defines
    `checkpoint_key`."""

    model_type: ClassVar[str]
    """The HF model_type its checkpoints carry."""
    family: ClassVar[str]
    """The family's name, for messages."""
    weight_prefixes: ClassVar[tuple[str, ...]]
    """Checkpoint names of the tower's and projector's tensors (the language model's are never read)."""
    width: int
    """Row width: the language model's hidden size."""

    def __init__(self, tp: TPContext | None) -> None:
        super().__init__()
        self.tp = tp or TPContext()

    @classmethod
    def from_checkpoint(
        cls: type[TowerT],
        model_dir: str | Path,
        tp: TPContext | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        config: Mapping[str, Any] | None = None,
    ) -> TowerT:
        """The tower of a checkpoint on `device` in `dtype`, this rank's shard of each tower and projector tensor
        read from its safetensors (the language model's never); `config`: its config.json if already read."""
        from eric_epd.models.registry import iter_vision_tensors  # here: the registry is to import the towers

        model_dir = Path(model_dir)
        config = read_config(model_dir) if config is None else config
        if config.get("model_type") != cls.model_type:
            raise ValueError(f"{model_dir} is model_type {config.get('model_type')!r}, not {cls.model_type}")
        tp = tp or TPContext()
        with torch.device("meta"):
            tower = cls(config, tp, dtype)  # type: ignore[call-arg]
        tower = tower.to_empty(device=torch.device(device)).eval()
        loaded = tower.load_weights(iter_vision_tensors(model_dir, cls.weight_prefixes))
        n_params = sum(p.numel() for p in tower.parameters())
        logger.info(
            "loaded %s tower from %s: %d tensors, %.1fM params/rank, %s on %s, tp %d/%d",
            cls.model_type,
            model_dir,
            len(loaded),
            n_params / 1e6,
            dtype,
            device,
            tp.rank,
            tp.world_size,
        )
        return tower

    @property
    def device(self) -> torch.device:
        """The device the tower's weights are on."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the tower's weights (pixels are cast to it, rows come out in it)."""
        return next(self.parameters()).dtype

    # ---- weights -------------------------------------------------------------------------------------------
    @staticmethod
    def checkpoint_key(name: str) -> str:
        """A checkpoint tensor name as the tower's parameter name (KeyError for a name outside the tower)."""
        raise NotImplementedError

    def skipped(self, key: str) -> bool:
        """Whether the tower leaves this checkpoint tensor unread (e.g. layers past the one its features come from)."""
        return False

    def expected_keys(self) -> set[str]:
        """Every tensor the checkpoint must provide, by `checkpoint_key` name (a fused qkv as its q, k and v)."""
        keys: set[str] = set()
        for name, _ in self.named_parameters():
            head, _, leaf = name.rpartition(".")
            if head.endswith(".qkv"):
                keys.update(f"{head[:-3]}{proj}.{leaf}" for proj in QKV_PARTS)
            else:
                keys.add(name)
        return keys

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (name, tensor-or-safetensors-slice) pairs under any of the checkpoint's spellings, each sliced to this
        rank's shard. Raises on unexpected or repeated names and, at the end, on any missing. Returns the keys."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, src in weights:
            key = self.checkpoint_key(name)
            if self.skipped(key):
                continue
            if key in loaded:
                raise KeyError(f"{self.family} weight {name!r} given twice")
            head, _, leaf = key.rpartition(".")
            owner, _, proj = head.rpartition(".")
            try:
                if proj in QKV_PARTS and f"{owner}.qkv.{leaf}" in params:
                    fused = self.get_submodule(f"{owner}.qkv")
                    fused.load_part(params[f"{owner}.qkv.{leaf}"], src, QKV_PARTS[proj])
                elif key in params:
                    loader = getattr(self.get_submodule(head), "weight_loader", None) or default_weight_loader
                    loader(params[key], src)
                else:
                    raise KeyError(f"unexpected {self.family} weight {name!r} for {type(self).__name__}")
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            loaded.add(key)
        missing = sorted(self.expected_keys() - loaded)
        if missing:
            raise KeyError(
                f"{len(missing)} {self.family} tower weights missing from the checkpoint, e.g. {missing[:5]}"
            )
        logger.debug(
            "loaded %d %s tower tensors (tp rank %d/%d)", len(loaded), self.model_type, self.tp.rank, self.tp.world_size
        )
        return loaded


class CropTower(ShardedTower):
    """A vision tower and projector over crops of one square size. forward(pixel_values (crops, C, S, S)) ->
    (crops * tokens_per_image, width) rows, crops in order, identical (replicated) on every tensor-parallel rank.
    A subclass builds its modules, sets the attributes below and defines `rows` and `checkpoint_key`."""

    channels: int
    image_size: int

    def rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """(crops, C, S, S) pixels on the tower's device and dtype, at least one crop -> (crops, tokens, width)."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Rows of every crop, crops in order: the layout of `get_image_features(...).pooler_output.flatten(0, 1)`."""
        size = (self.channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != size:
            expected = ", ".join(map(str, size))
            raise ValueError(f"pixel_values of shape {list(pixel_values.shape)}; expected [crops, {expected}]")
        if pixel_values.shape[0] == 0:
            return torch.empty(0, self.width, dtype=self.dtype, device=self.device)
        return self.rows(pixel_values.to(device=self.device, dtype=self.dtype)).flatten(0, 1)


def check_tower_tp(tower: type[ShardedTower], config: Mapping[str, Any], tp: int) -> None:
    """ValueError, before any process starts, unless `tower` for `config` (a config.json) splits over `tp` ranks;
    the tower is built on the meta device, nothing allocated."""
    with torch.device("meta"):
        tower(config, TPContext(0, tp))  # type: ignore[call-arg]


class TowerEncoder:
    """A tower of Eric's own behind the generic path's encoder interface (`HFVisionEncoder.encode`): loading this
    rank's shard, its row width and dtype; a subclass names its tower class and writes `encode`."""

    tower_class: ClassVar[type[ShardedTower]]

    def __init__(self, tower: Any) -> None:
        self.tower = tower
        self.width: int = tower.width
        """Row width: the language model's hidden size."""
        self.dtype: torch.dtype = tower.dtype
        """The dtype the tower was loaded in: inputs go in and rows come out in it."""

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPContext | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Self:
        """This rank's shard of the checkpoint's tower (see ShardedTower.from_checkpoint)."""
        return cls(cls.tower_class.from_checkpoint(model_dir, tp, dtype, device, config))


class CropTowerEncoder(TowerEncoder):
    """A crop tower behind the encoder interface: a batch of items' joined processor tensors in, each item's rows
    out: images, and where `modalities` says so videos whose frames come as crops (InternVL's: vLLM runs them through
    its image path, one tile a frame). A subclass names its tower class."""

    tower_class: ClassVar[type[CropTower]]
    modalities: ClassVar[tuple[str, ...]] = ("image",)
    """What it encodes: images, and for a family whose video frames come as crops also "video"."""

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "image") -> list[torch.Tensor]:
        """Each item's [rows, width] output for a batch whose `pixel_values` hold the items' crops (a video's: its
        frames) one after another (the processor's other tensors are not needed: every crop gives the same number
        of rows)."""
        family = self.tower.family
        if modality not in self.modalities:
            encodes = " and ".join(f"{m}s" for m in self.modalities)
            raise RuntimeError(f"the {family} tower encodes {encodes}, not {modality}s")
        if "pixel_values" not in inputs:
            raise RuntimeError(f"a {family} {modality} batch needs pixel_values; it has {sorted(inputs)}")
        flat = self.tower(inputs["pixel_values"])
        if flat.shape[0] != sum(rows):
            raise RuntimeError(f"the tower gave {flat.shape[0]} rows for items of {rows} rows")
        return list(flat.split(rows))
