"""Tensor-parallel Gemma 3 vision tower: SigLIP (heads and MLP split over ranks) and Gemma 3's pooling projector,
equal to transformers' `get_image_features(pixel_values).pooler_output` as rows; Gemma3Encoder serves it to Eric."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eric_epd.models.facts import read_config
from eric_epd.models.layers.parallel import (
    QKVParallelLinear,
    RowParallelLinear,
    TPContext,
    copy_into,
    default_weight_loader,
    read_rows,
)
from eric_epd.models.qwen2_5_vl import RMSNorm
from eric_epd.models.qwen2_vl import VisionMLP, config_to_dict

logger = logging.getLogger(__name__)

WEIGHT_PREFIXES: tuple[str, ...] = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
"""Checkpoint names of the tower and projector: released (`vision_tower.vision_model.*`), transformers 5's
(`model.vision_tower.*`, no `vision_model` level) and the mixes; the language model's are never read."""
SIGLIP_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6})
"""transformers' SiglipVisionConfig defaults, for keys a checkpoint's vision_config leaves out."""
QKV_PARTS: Mapping[str, int] = MappingProxyType({"q_proj": 0, "k_proj": 1, "v_proj": 2})
"""The checkpoint's separate projections, by their place in the fused qkv."""


def checkpoint_key(name: str) -> str:
    """A checkpoint tensor name as the tower's: `model.` and `vision_tower.[vision_model.]` dropped, projector kept."""
    name = name.removeprefix("model.")
    for prefix in ("vision_tower.vision_model.", "vision_tower."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith("multi_modal_projector."):
        return name
    raise KeyError(f"{name!r} is not a Gemma 3 vision tower or projector weight")


class SiglipEmbeddings(nn.Module):
    """Patch embedding (a stride-`patch` conv) plus one learned position embedding per patch (no interpolation)."""

    def __init__(self, channels: int, dim: int, patch: int, num_patches: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, dim, patch, stride=patch, dtype=dtype)
        self.position_embedding = nn.Embedding(num_patches, dim, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) crops -> (B, patches, dim) token embeddings, patches row-major."""
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    """Unmasked multi-head self-attention: fused qkv column-parallel by heads, out_proj row-parallel (all-reduce)."""

    def __init__(self, dim: int, num_heads: int, tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.qkv = QKVParallelLinear(dim, num_heads, True, tp, dtype)
        self.out_proj = RowParallelLinear(dim, dim, True, tp, dtype)
        self.tp = tp
        self.heads = self.qkv.num_heads_local
        self.head_dim = dim // num_heads

    def load_qkv_part(self, param: torch.Tensor, src: Any, part: int) -> None:
        """Load this rank's heads of the checkpoint's q (part 0), k (1) or v (2) weight or bias into the fused qkv."""
        local = self.qkv.local
        start = self.tp.rank * local
        copy_into(param.narrow(0, part * local, local), read_rows(src, start, start + local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, dim) -> (B, L, dim): this rank's heads attend over each crop's tokens, summed over ranks."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm block: x + self_attn(layer_norm1(x)); x + mlp(layer_norm2(x)) (fc1 column, fc2 row-parallel)."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim, eps = int(cfg["hidden_size"]), float(cfg["layer_norm_eps"])
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps, dtype=dtype)
        self.self_attn = SiglipAttention(dim, int(cfg["num_attention_heads"]), tp, dtype)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(dim, int(cfg["intermediate_size"]), str(cfg["hidden_act"]), tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One transformer block over (B, L, dim)."""
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    """The stack of encoder layers (its own level so parameter names follow the checkpoint's `encoder.layers.N`)."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg, tp, dtype) for _ in range(int(cfg["num_hidden_layers"])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer in turn."""
        for layer in self.layers:
            x = layer(x)
        return x


class Gemma3RMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalized in float32, scaled by (1 + weight) in float32, then cast to the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMS-normalize `x` over its last dimension, then scale by 1 + weight (all in float32)."""
        return (self.normalized(x) * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    """Average-pools each crop's patch grid to tokens_per_side**2 tokens, RMS-normalizes, projects to the text width."""

    def __init__(
        self, dim: int, text_dim: int, patches_per_side: int, tokens: int, eps: float, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.tokens_per_side = int(tokens**0.5)
        if self.tokens_per_side**2 != tokens or patches_per_side % self.tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {tokens} is not a square pooling of a "
                             f"{patches_per_side}x{patches_per_side} patch grid")
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // self.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(dim, text_dim, dtype=dtype), requires_grad=False)
        self.mm_soft_emb_norm = Gemma3RMSNorm(dim, eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, patches, dim) -> (B, tokens, text_dim)."""
        batch, _, dim = x.shape
        grid = x.transpose(1, 2).reshape(batch, dim, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3VisionTower(nn.Module):
    """Gemma 3's SigLIP tower and projector. forward(pixel_values (crops, 3, S, S)) -> (crops * mm_tokens_per_image,
    text hidden size) rows, crops in order, identical (replicated) on every tensor-parallel rank."""

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        full = config_to_dict(config)
        cfg = {**SIGLIP_DEFAULTS, **config_to_dict(full.get("vision_config") or {})}
        self.tp = tp or TPContext()
        self.image_size, self.patch_size = int(cfg["image_size"]), int(cfg["patch_size"])
        self.channels = int(cfg["num_channels"])
        self.tokens_per_image = int(full.get("mm_tokens_per_image", 256))
        self.width = int(config_to_dict(full.get("text_config") or {}).get("hidden_size", 2304))
        """Row width: the language model's hidden size."""
        dim, side = int(cfg["hidden_size"]), self.image_size // self.patch_size
        if dim % int(cfg["num_attention_heads"]):
            raise ValueError(f"vision width {dim} not divisible by {cfg['num_attention_heads']} heads")
        self.embeddings = SiglipEmbeddings(self.channels, dim, self.patch_size, side * side, dtype)
        self.encoder = SiglipEncoder(cfg, self.tp, dtype)
        self.post_layernorm = nn.LayerNorm(dim, eps=float(cfg["layer_norm_eps"]), dtype=dtype)
        self.multi_modal_projector = Gemma3Projector(dim, self.width, side, self.tokens_per_image,
                                                     float(cfg["layer_norm_eps"]), dtype)

    @classmethod
    def from_checkpoint(
        cls, model_dir: str | Path, tp: TPContext | None = None, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu", config: Mapping[str, Any] | None = None,
    ) -> Gemma3VisionTower:
        """The tower of a Gemma 3 checkpoint on `device` in `dtype`, this rank's shard of each vision and projector
        tensor read from its safetensors (the language model's never); `config`: its config.json if already read."""
        from eric_epd.models.registry import iter_vision_tensors  # here: the registry is to import this module

        model_dir = Path(model_dir)
        config = read_config(model_dir) if config is None else config
        if config.get("model_type") != "gemma3":
            raise ValueError(f"{model_dir} is model_type {config.get('model_type')!r}, not gemma3")
        tp = tp or TPContext()
        with torch.device("meta"):
            tower = cls(config, tp, dtype)
        tower = tower.to_empty(device=torch.device(device)).eval()
        loaded = tower.load_weights(iter_vision_tensors(model_dir, WEIGHT_PREFIXES))
        n_params = sum(p.numel() for p in tower.parameters())
        logger.info("loaded gemma3 vision tower from %s: %d tensors, %.1fM params/rank, %s on %s, tp %d/%d",
                    model_dir, len(loaded), n_params / 1e6, dtype, device, tp.rank, tp.world_size)
        return tower

    @property
    def device(self) -> torch.device:
        """The device the tower's weights are on."""
        return self.post_layernorm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the tower's weights (pixels are cast to it, rows come out in it)."""
        return self.post_layernorm.weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Rows of every crop, crops in order: the layout of `get_image_features(...).pooler_output.flatten(0, 1)`."""
        size = (self.channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != size:
            expected = ", ".join(map(str, size))
            raise ValueError(f"pixel_values of shape {list(pixel_values.shape)}; expected [crops, {expected}]")
        if pixel_values.shape[0] == 0:
            return torch.empty(0, self.width, dtype=self.dtype, device=self.device)
        x = self.embeddings(pixel_values.to(device=self.device, dtype=self.dtype))
        x = self.post_layernorm(self.encoder(x))
        return self.multi_modal_projector(x).flatten(0, 1)

    # ---- weights -------------------------------------------------------------------------------------------
    def expected_keys(self) -> set[str]:
        """Every tensor the checkpoint must provide, by `checkpoint_key` name (the fused qkv as its q, k and v)."""
        keys: set[str] = set()
        for name, _ in self.named_parameters():
            head, _, leaf = name.rpartition(".")
            if head.endswith(".self_attn.qkv"):
                keys.update(f"{head[:-3]}{proj}.{leaf}" for proj in QKV_PARTS)
            else:
                keys.add(name)
        return keys

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (name, tensor-or-safetensors-slice) pairs under any `WEIGHT_PREFIXES` spelling, each sliced to this
        rank's shard. Raises on unexpected or repeated names and, at the end, on any missing. Returns the keys."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, src in weights:
            key = checkpoint_key(name)
            if key in loaded:
                raise KeyError(f"vision weight {name!r} given twice")
            head, _, leaf = key.rpartition(".")
            owner, _, proj = head.rpartition(".")
            try:
                if proj in QKV_PARTS and owner.endswith(".self_attn") and f"{owner}.qkv.{leaf}" in params:
                    attn = self.get_submodule(owner)
                    attn.load_qkv_part(params[f"{owner}.qkv.{leaf}"], src, QKV_PARTS[proj])
                elif key in params:
                    loader = getattr(self.get_submodule(head), "weight_loader", None) or default_weight_loader
                    loader(params[key], src)
                else:
                    raise KeyError(f"unexpected vision weight {name!r} for {type(self).__name__}")
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            loaded.add(key)
        missing = sorted(self.expected_keys() - loaded)
        if missing:
            raise KeyError(f"{len(missing)} vision weights missing from the checkpoint, e.g. {missing[:5]}")
        logger.debug("loaded %d gemma3 vision tensors (tp rank %d/%d)", len(loaded), self.tp.rank, self.tp.world_size)
        return loaded


def check_tp(config: Mapping[str, Any], tp: int) -> None:
    """ValueError, before any process starts, unless the tower of `config` (a config.json) splits over `tp` ranks
    (its attention heads and MLP width divide by it); the tower is built on the meta device, nothing allocated."""
    with torch.device("meta"):
        Gemma3VisionTower(config, TPContext(0, tp))


class Gemma3Encoder:
    """The tower behind the generic path's encoder interface (`HFVisionEncoder.encode`): a batch of items' joined
    processor tensors in, each item's rows out. Images only (Gemma 3 has no video features)."""

    def __init__(self, tower: Gemma3VisionTower) -> None:
        self.tower = tower
        self.width = tower.width
        """Row width: the language model's hidden size."""
        self.dtype = tower.dtype
        """The dtype the tower was loaded in: pixels go in and rows come out in it."""

    @classmethod
    def load(
        cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, tp: TPContext | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Gemma3Encoder:
        """This rank's shard of the checkpoint's tower and projector (see Gemma3VisionTower.from_checkpoint)."""
        return cls(Gemma3VisionTower.from_checkpoint(model_dir, tp, dtype, device, config))

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "image") -> list[torch.Tensor]:
        """Each item's [rows, width] output for a batch whose `pixel_values` hold the items' crops one after another
        (the processor's other tensors, e.g. num_crops, are not needed: every crop gives mm_tokens_per_image rows)."""
        if modality != "image":
            raise RuntimeError(f"the Gemma 3 tower encodes images, not {modality}")
        if "pixel_values" not in inputs:
            raise RuntimeError(f"a Gemma 3 batch needs pixel_values; it has {sorted(inputs)}")
        flat = self.tower(inputs["pixel_values"])
        if flat.shape[0] != sum(rows):
            raise RuntimeError(f"the tower gave {flat.shape[0]} rows for items of {rows} rows")
        return list(flat.split(rows))
