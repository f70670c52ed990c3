"""Tensor-parallel InternVL 3 vision tower (transformers layout): InternViT (heads and MLP split over ranks) and the
pixel-shuffle projector, equal to transformers' `get_image_features(pixel_values).pooler_output` as rows."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from eric_epd.models.crop_tower import CropTower, CropTowerEncoder, check_tower_tp
from eric_epd.models.layers.activations import get_activation
from eric_epd.models.layers.attention import dense_attention
from eric_epd.models.layers.config import config_to_dict
from eric_epd.models.layers.mlp import VisionMLP
from eric_epd.models.layers.parallel import QKVParallelLinear, RowParallelLinear, TPContext, copy_into, read_rows
from eric_epd.models.qwen2_5_vl import RMSNorm

logger = logging.getLogger(__name__)

WEIGHT_PREFIXES: tuple[str, ...] = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
"""Checkpoint names of the tower and projector: released `-hf` checkpoints' (`vision_tower.*`) and transformers 5's
(`model.vision_tower.*`); the language model's are never read."""
INTERNVIT_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "attention_bias": False,
        "use_qk_norm": False,
        "intermediate_size": 4096,
        "hidden_act": "gelu",
        "norm_type": "layer_norm",
        "layer_norm_eps": 1e-6,
        "image_size": 448,
        "patch_size": 14,
        "num_channels": 3,
        "use_absolute_position_embeddings": True,
        "use_mean_pooling": True,
    }
)
"""transformers' InternVLVisionConfig defaults, for keys a checkpoint's vision_config leaves out."""
TEXT_HIDDEN_DEFAULT = 4096
"""InternVLConfig's language model width when its text_config leaves hidden_size out (transformers' Qwen2Config)."""
QK_NORM_EPS = 1e-6
"""transformers builds the q and k norms with RMSNorm's default eps, not the config's layer_norm_eps."""
PROJECTOR_EPS = 1e-5
"""The projector's LayerNorm has nn.LayerNorm's default eps."""


def checkpoint_key(name: str) -> str:
    """A checkpoint tensor name as the tower's: `model.` and `vision_tower.` dropped, projector names kept."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return name.removeprefix("vision_tower.")
    if name.startswith("multi_modal_projector."):
        return name
    raise KeyError(f"{name!r} is not an InternVL vision tower or projector weight")


def square(value: Any, what: str) -> int:
    """One side of a square image or patch size given as an int or an [h, w] pair."""
    sides = [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)] * 2
    if sides[0] != sides[1]:
        raise ValueError(f"{what} {value} is not square: transformers' InternVL reshapes features to a square grid")
    return sides[0]


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """transformers' InternVLModel.pixel_shuffle at downsample ratio 1/scale, then flattened: (B, side, side, C) ->
    (B, (side/scale)^2, C*scale^2), each `scale` x `scale` block of patches one token."""
    batch, rows, cols, dim = x.shape
    x = x.view(batch, rows, cols // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(batch, cols // scale, rows // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(batch, -1, dim * scale * scale)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over features split across ranks (the q or k norm, over every head): each rank holds its features'
    weights, the sum of squares is all-reduced."""

    def __init__(self, dim: int, tp: TPContext, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__(tp.shard(dim, "qk-norm features"), eps, dtype)
        self.dim, self.tp = dim, tp

    def weight_loader(self, param: torch.Tensor, src: Any) -> None:
        """Load this rank's block of the weight."""
        start = self.tp.rank * param.shape[0]
        copy_into(param, read_rows(src, start, start + param.shape[0]))

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """`x` divided by the root mean square of all ranks' features, in float32."""
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        return xf * torch.rsqrt(squares / self.dim + self.eps)


class InternVisionEmbeddings(nn.Module):
    """Patch embedding (a stride-`patch` conv), a cls token in front, plus learned position embeddings (cls first)."""

    def __init__(self, cfg: Mapping[str, Any], channels: int, patch: int, side: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim = int(cfg["hidden_size"])
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim, dtype=dtype), requires_grad=False)
        self.patch_embeddings = nn.ModuleDict({"projection": nn.Conv2d(channels, dim, patch, patch, dtype=dtype)})
        self.position_embeddings = (
            nn.Parameter(torch.empty(1, side * side + 1, dim, dtype=dtype), requires_grad=False)
            if cfg["use_absolute_position_embeddings"]
            else None
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) crops -> (B, 1 + patches, dim): the cls token, then the patches row-major."""
        x = self.patch_embeddings["projection"](pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x if self.position_embeddings is None else x + self.position_embeddings


class InternVisionAttention(nn.Module):
    """Unmasked multi-head self-attention: q, k, v fused and split by heads (optionally RMS-normalized over all
    heads), projection_layer row-parallel (all-reduce)."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        self.qkv = QKVParallelLinear(dim, heads, bool(cfg["attention_bias"]), tp, dtype)
        self.projection_layer = RowParallelLinear(dim, dim, True, tp, dtype)
        self.heads, self.head_dim, self.local = self.qkv.num_heads_local, dim // heads, self.qkv.local
        self.q_norm = ShardedRMSNorm(dim, tp, QK_NORM_EPS, dtype) if cfg["use_qk_norm"] else None
        self.k_norm = ShardedRMSNorm(dim, tp, QK_NORM_EPS, dtype) if cfg["use_qk_norm"] else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, dim) -> (B, L, dim): this rank's heads attend over each crop's tokens, summed over ranks."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split(self.local, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(batch, length, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = dense_attention(q, k, v, self.head_dim**-0.5)
        return self.projection_layer(out.transpose(1, 2).reshape(batch, length, self.local))


def make_norm(cfg: Mapping[str, Any], dtype: torch.dtype | None) -> nn.Module:
    """The encoder layers' norm: LayerNorm or RMSNorm as config.norm_type says, with its layer_norm_eps."""
    dim, eps = int(cfg["hidden_size"]), float(cfg["layer_norm_eps"])
    if cfg["norm_type"] == "layer_norm":
        return nn.LayerNorm(dim, eps=eps, dtype=dtype)
    if cfg["norm_type"] == "rms_norm":
        return RMSNorm(dim, eps, dtype)
    raise ValueError(f"unknown InternViT norm_type {cfg['norm_type']!r}; layer_norm or rms_norm")


class InternVisionLayer(nn.Module):
    """Pre-norm block with layer scale: x + lambda_1 * attention(norm(x)); x + lambda_2 * mlp(norm(x))."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim = int(cfg["hidden_size"])
        self.layernorm_before = make_norm(cfg, dtype)
        self.attention = InternVisionAttention(cfg, tp, dtype)
        self.layernorm_after = make_norm(cfg, dtype)
        self.mlp = VisionMLP(dim, int(cfg["intermediate_size"]), str(cfg["hidden_act"]), tp, dtype)
        self.lambda_1 = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.lambda_2 = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block over (B, L, dim); each scale and residual add in one pass (addcmul)."""
        x = torch.addcmul(x, self.attention(self.layernorm_before(x)), self.lambda_1)
        return torch.addcmul(x, self.mlp(self.layernorm_after(x)), self.lambda_2)


class InternVLProjector(nn.Module):
    """LayerNorm, linear_1, activation, linear_2 over pixel-shuffled tokens (replicated on every rank)."""

    def __init__(self, dim: int, text_dim: int, act: str, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(dim, eps=PROJECTOR_EPS, dtype=dtype)
        self.linear_1 = nn.Linear(dim, text_dim, dtype=dtype)
        self.act = get_activation(act)
        self.linear_2 = nn.Linear(text_dim, text_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, tokens, dim) -> (B, tokens, text_dim)."""
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def feature_depth(layer: Any, num_layers: int) -> int:
    """How many encoder layers run for `vision_feature_layer` (transformers: -1 the last hidden state, else
    hidden_states[layer], the embeddings being hidden_states[0])."""
    if isinstance(layer, list | tuple) or not -num_layers - 1 <= int(layer) <= num_layers:
        raise ValueError(f"vision_feature_layer {layer!r}: one layer of {num_layers} (0 to {num_layers}, or negative)")
    return int(layer) if int(layer) >= 0 else num_layers + 1 + int(layer)


class InternVLVisionTower(CropTower):
    """InternVL's InternViT and projector. forward(pixel_values (crops, 3, S, S)) -> (crops * (S/patch *
    downsample_ratio)^2, text hidden size) rows, crops in order, identical (replicated) on every tensor-parallel rank.
    Only the layers up to config.vision_feature_layer are built and read."""

    model_type = "internvl"
    family = "InternVL"
    weight_prefixes = WEIGHT_PREFIXES
    checkpoint_key = staticmethod(checkpoint_key)

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tp)
        full = config_to_dict(config)
        cfg = {**INTERNVIT_DEFAULTS, **config_to_dict(full.get("vision_config") or {})}
        self.image_size, self.patch_size = square(cfg["image_size"], "image_size"), square(cfg["patch_size"], "patch")
        self.channels, side = int(cfg["num_channels"]), self.image_size // self.patch_size
        self.width = int(config_to_dict(full.get("text_config") or {}).get("hidden_size", TEXT_HIDDEN_DEFAULT))
        """Row width: the language model's hidden size."""
        strategy = full.get("vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ValueError(
                f"vision_feature_select_strategy {strategy!r}: only 'default' (cls token dropped) gives "
                "the square patch grid transformers' InternVL pixel-shuffles"
            )
        ratio = float(full.get("downsample_ratio", 0.5))
        self.scale = round(1 / ratio)
        if abs(self.scale * ratio - 1) > 1e-9 or side % self.scale:
            raise ValueError(f"downsample_ratio {ratio} does not evenly shrink a {side}x{side} patch grid")
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if dim % heads:
            raise ValueError(f"vision width {dim} not divisible by {heads} heads")
        layer, self.num_layers = full.get("vision_feature_layer", -1), int(cfg["num_hidden_layers"])
        depth = feature_depth(layer, self.num_layers)
        self.embeddings = InternVisionEmbeddings(cfg, self.channels, self.patch_size, side, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(InternVisionLayer(cfg, self.tp, dtype) for _ in range(depth))
        final_norm = layer == -1 and not cfg["use_mean_pooling"]  # transformers' last_hidden_state is normed
        self.layernorm = nn.LayerNorm(dim, eps=float(cfg["layer_norm_eps"]), dtype=dtype) if final_norm else None
        self.multi_modal_projector = InternVLProjector(
            dim * self.scale**2, self.width, str(full.get("projector_hidden_act", "gelu")), dtype
        )

    def rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """(crops, 3, S, S) -> (crops, tokens, width): InternViT to the feature layer, the cls token dropped, pixel
        shuffle, the projector."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        if self.layernorm is not None:
            x = self.layernorm(x)
        side = self.image_size // self.patch_size
        grid = x[:, 1:].reshape(x.shape[0], side, side, x.shape[-1])
        return self.multi_modal_projector(pixel_shuffle(grid, self.scale))

    def skipped(self, key: str) -> bool:
        """Checkpoint tensors the features never use: layers past the feature layer, the final layernorm when they
        are not the last hidden state, the mask token."""
        if key.startswith("encoder.layer."):
            index = int(key.split(".")[2])
            return len(self.encoder.layer) <= index < self.num_layers
        return key == "embeddings.mask_token" or (key.startswith("layernorm.") and self.layernorm is None)


def check_tp(config: Mapping[str, Any], tp: int) -> None:
    """ValueError, before any process starts, unless the tower of `config` (a config.json) splits over `tp` ranks
    (its attention heads and MLP width divide by it); the tower is built on the meta device, nothing allocated."""
    check_tower_tp(InternVLVisionTower, config, tp)


class InternVLEncoder(CropTowerEncoder):
    """The InternVL tower behind the generic path's encoder interface (images, and videos' frames as crops)."""

    tower_class = InternVLVisionTower
    modalities = ("image", "video")


ENCODER = InternVLEncoder
"""The encoder GenericWorkload loads for this family (facts.GENERIC_TOWERS)."""
