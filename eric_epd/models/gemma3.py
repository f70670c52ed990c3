"""Tensor-parallel Gemma 3 vision tower: SigLIP (heads and MLP split over ranks) and Gemma 3's pooling projector,
equal to transformers' `get_image_features(pixel_values).pooler_output` as rows; Gemma3Encoder serves it to Eric."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eric_epd.models.crop_tower import CropTower, CropTowerEncoder, check_tower_tp
from eric_epd.models.layers.attention import dense_attention
from eric_epd.models.layers.config import config_to_dict
from eric_epd.models.layers.mlp import VisionMLP
from eric_epd.models.layers.parallel import QKVParallelLinear, RowParallelLinear, TPContext
from eric_epd.models.qwen2_5_vl import RMSNorm

logger = logging.getLogger(__name__)

WEIGHT_PREFIXES: tuple[str, ...] = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
"""Checkpoint names of the tower and projector: released (`vision_tower.vision_model.*`), transformers 5's
(`model.vision_tower.*`, no `vision_model` level) and the mixes; the language model's are never read."""
SIGLIP_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }
)
"""transformers' SiglipVisionConfig defaults, for keys a checkpoint's vision_config leaves out."""


def checkpoint_key(name: str) -> str:
    """A checkpoint tensor name as the tower's: `model.` and `vision_tower.[vision_model.]` dropped, projector kept."""
    name = name.removeprefix("model.")
    for prefix in ("vision_tower.vision_model.", "vision_tower."):
        if name.startswith(prefix):
            return name[len(prefix) :]
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
        self.heads = self.qkv.num_heads_local
        self.head_dim = dim // num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, dim) -> (B, L, dim): this rank's heads attend over each crop's tokens, summed over ranks."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = dense_attention(q, k, v, self.head_dim**-0.5)
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
            raise ValueError(
                f"mm_tokens_per_image {tokens} is not a square pooling of a "
                f"{patches_per_side}x{patches_per_side} patch grid"
            )
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


class Gemma3VisionTower(CropTower):
    """Gemma 3's SigLIP tower and projector. forward(pixel_values (crops, 3, S, S)) -> (crops * mm_tokens_per_image,
    text hidden size) rows, crops in order, identical (replicated) on every tensor-parallel rank."""

    model_type = "gemma3"
    family = "Gemma 3"
    weight_prefixes = WEIGHT_PREFIXES
    checkpoint_key = staticmethod(checkpoint_key)

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tp)
        full = config_to_dict(config)
        cfg = {**SIGLIP_DEFAULTS, **config_to_dict(full.get("vision_config") or {})}
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
        self.multi_modal_projector = Gemma3Projector(
            dim, self.width, side, self.tokens_per_image, float(cfg["layer_norm_eps"]), dtype
        )

    def rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """(crops, 3, S, S) -> (crops, mm_tokens_per_image, width): SigLIP, post-layernorm, the pooling projector."""
        return self.multi_modal_projector(self.post_layernorm(self.encoder(self.embeddings(pixels))))


def check_tp(config: Mapping[str, Any], tp: int) -> None:
    """ValueError, before any process starts, unless the tower of `config` (a config.json) splits over `tp` ranks
    (its attention heads and MLP width divide by it); the tower is built on the meta device, nothing allocated."""
    check_tower_tp(Gemma3VisionTower, config, tp)


class Gemma3Encoder(CropTowerEncoder):
    """The Gemma 3 tower behind the generic path's encoder interface (Gemma 3 has no video features)."""

    tower_class = Gemma3VisionTower


ENCODER = Gemma3Encoder
"""The encoder GenericWorkload loads for this family (facts.GENERIC_TOWERS)."""
