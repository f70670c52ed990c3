"""Tensor-parallel Qwen2-VL vision tower (patch embed, ViT blocks, patch merger) equal to HF's `model.visual`.

Shared pieces (patch embed, attention, blocks, merger, weight loading) are reused by the Qwen2.5-VL encoder.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from eric_epd.common.tower_defaults import QWEN2_VL
from eric_epd.models.layers.attention import VarlenPlan, apply_vision_rope, varlen_attention, vision_rotary_cos_sin
from eric_epd.models.layers.config import IGNORED_SUFFIXES, config_to_dict
from eric_epd.models.layers.mlp import VisionMLP
from eric_epd.models.layers.parallel import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPContext,
    copy_into,
    default_weight_loader,
    read_full,
)

logger = logging.getLogger(__name__)

VISION_PREFIXES: tuple[str, ...] = ("model.visual.", "visual.")

Grid = list[tuple[int, int, int]]


def rope_theta(cfg: dict[str, Any]) -> float:
    """Vision rope base: rope_parameters.rope_theta in transformers 5 configs, 10000 otherwise."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> Grid:
    """(n, 3) grid as a list of int triples."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def vision_position_ids(grid: Grid, merge: int) -> torch.Tensor:
    """(N, 2) (row, col) patch coordinates in the processor's merge-block order, repeated over frames."""
    out = []
    for t, h, w in grid:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hw = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def frame_cu_seqlens(grid: Grid) -> list[int]:
    """Cumulative boundaries of per-frame attention segments (h*w tokens each, t per item)."""
    cu = [0]
    for t, h, w in grid:
        base = cu[-1]
        cu.extend(base + h * w * (i + 1) for i in range(t))
    return cu


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with HF's vision eps."""

    def __init__(self, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, eps=1e-6, dtype=dtype)


class PatchProj(nn.Module):
    """Conv3d with stride == kernel as a Linear over flat (C, T, P, P) patches; loads the 5-D conv weight."""

    def __init__(self, in_dim: int, embed_dim: int, dtype: torch.dtype | None, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(embed_dim, in_dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(embed_dim, dtype=dtype), requires_grad=False) if bias else None

    def weight_loader(self, param: torch.Tensor, full: Any) -> None:
        """Load the 5-D conv weight flattened to (embed_dim, in_dim); the bias as is."""
        tensor = read_full(full)
        copy_into(param, tensor.reshape(param.shape[0], -1) if param.dim() == 2 else tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed flat patches: the conv as a Linear."""
        return F.linear(x, self.weight, self.bias)


class PatchEmbed(nn.Module):
    """Embeds flattened (C*T*P*P) patches; the weight is HF's `patch_embed.proj` Conv3d weight, reshaped."""

    def __init__(
        self,
        in_channels: int,
        temporal_patch_size: int,
        patch_size: int,
        embed_dim: int,
        dtype: torch.dtype | None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.in_dim = in_channels * temporal_patch_size * patch_size * patch_size
        self.proj = PatchProj(self.in_dim, embed_dim, dtype, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed pixel rows, each flattened to one (C, T, P, P) patch."""
        return self.proj(x.reshape(-1, self.in_dim))


class VisionAttention(nn.Module):
    """Fused-qkv self-attention; heads split over ranks (qkv column-parallel, proj row-parallel)."""

    def __init__(self, dim: int, num_heads: int, tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.qkv = QKVParallelLinear(dim, num_heads, True, tp, dtype)
        self.proj = RowParallelLinear(dim, dim, True, tp, dtype)
        self.heads = self.qkv.num_heads_local
        self.head_dim = dim // num_heads

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q and k (rotary positions applied) and v of this rank's heads, each (N, heads, head_dim)."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        return (*apply_vision_rope(q, k, cos, sin), v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        """Attention within each segment of `plan`, heads side by side (N, heads * head_dim), not yet projected."""
        return varlen_attention(q, k, v, plan, scale=self.head_dim**-0.5).reshape(q.shape[0], -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        """Attention of this rank's heads within each segment of `plan`, rotary positions applied, then projected."""
        return self.proj(self.attend(*self.rotated_qkv(x, cos, sin), plan))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Everything before attention: norm, q/k/v, rotary positions (`--compile` compiles it, token count
        dynamic)."""
        return self.attn.rotated_qkv(self.norm1(x), cos, sin)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Everything after attention: projection, residual, MLP, residual (`--compile` compiles it too)."""
        x = x + self.attn.proj(attended)
        return x + self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        """Pre-norm residual block: attention (eager: its segments vary per batch), then MLP."""
        return self.finish(x, self.attn.attend(*self.attention_inputs(x, cos, sin), plan))


class _Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class PatchMerger(nn.Module):
    """Norm, group merge**2 neighbouring tokens, then Linear (column) -> GELU -> Linear (row). With `postshuffle`
    the norm runs over the grouped tokens instead (Qwen3-VL's DeepStack mergers)."""

    def __init__(
        self,
        norm: nn.Module,
        context_dim: int,
        out_dim: int,
        merge: int,
        tp: TPContext,
        dtype: torch.dtype | None,
        postshuffle: bool = False,
    ) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.postshuffle = postshuffle
        self.ln_q = norm
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.hidden, self.hidden, True, tp, dtype),
            _Gelu(),
            RowParallelLinear(self.hidden, out_dim, True, tp, dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Merge each group of merge**2 neighbouring tokens into one output token."""
        if self.postshuffle:
            return self.mlp(self.ln_q(x.reshape(-1, self.hidden)))
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VLVisionEncoder(nn.Module):
    """Qwen2-VL vision tower. forward(pixel_values (P, C*T*p*p), grid_thw (n, 3)) -> (P // merge**2, out_dim),
    identical (replicated) on every tensor-parallel rank."""

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        cfg = {**self.defaults, **config_to_dict(config)}
        self.cfg = cfg
        self.tp = tp or TPContext()
        self.param_dtype = dtype
        self.width, self.out_dim = self._dims(cfg)
        self.num_heads = int(cfg["num_heads"])
        self.depth = int(cfg["depth"])
        self.merge = int(cfg["spatial_merge_size"])
        self.patch_size = int(cfg["patch_size"])
        self.temporal_patch_size = int(cfg["temporal_patch_size"])
        self.in_channels = int(cfg["in_channels"])
        self.rope_theta = rope_theta(cfg)
        if self.width % self.num_heads:
            raise ValueError(f"vision width {self.width} not divisible by {self.num_heads} heads")
        self.head_dim = self.width // self.num_heads
        self.patch_embed = PatchEmbed(self.in_channels, self.temporal_patch_size, self.patch_size, self.width, dtype)
        self.blocks = nn.ModuleList([self._make_block(i) for i in range(self.depth)])
        self.merger = PatchMerger(self._make_norm(self.width), self.width, self.out_dim, self.merge, self.tp, dtype)

    # ---- per-family construction hooks -------------------------------------------------------------------
    defaults: ClassVar[Mapping[str, Any]] = QWEN2_VL
    """transformers' values for the keys a checkpoint's vision_config leaves out (common/tower_defaults.py); every
    size, depth and index is read from the config, these filling only what it does not say."""

    def _dims(self, cfg: dict[str, Any]) -> tuple[int, int]:
        return int(cfg["embed_dim"]), int(cfg["hidden_size"])

    def _make_norm(self, dim: int) -> nn.Module:
        return LayerNorm(dim, dtype=self.param_dtype)

    def _make_mlp(self) -> nn.Module:
        hidden = int(self.width * float(self.cfg["mlp_ratio"]))
        return VisionMLP(self.width, hidden, self.cfg["hidden_act"], self.tp, self.param_dtype)

    def _make_block(self, index: int) -> VisionBlock:
        attn = VisionAttention(self.width, self.num_heads, self.tp, self.param_dtype)
        return VisionBlock(self._make_norm(self.width), self._make_norm(self.width), attn, self._make_mlp())

    tap_layers: frozenset[int] = frozenset()
    cuda_graphs: bool = False
    """Set by compile_parts on CUDA: the compiled parts replay CUDA graphs, whose outputs the next forward reuses."""
    """Blocks whose output also feeds a level of the result (Qwen3-VL's DeepStack); none here."""

    def _embed(self, pixels: torch.Tensor, grid: Grid) -> torch.Tensor:
        """Patch rows -> token embeddings, in the processor's merge-block order."""
        return self.patch_embed(pixels)

    def _tap(self, index: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def param_name(key: str) -> str:
        """A checkpoint key (prefix stripped) as this module's parameter name."""
        return key

    def _layout(self, grid: Grid, device: torch.device) -> tuple[list[VarlenPlan], torch.Tensor | None]:
        """Attention plan per block and an optional permutation of merge units (None: natural order)."""
        plan = VarlenPlan.build(frame_cu_seqlens(grid), device)
        return [plan] * self.depth, None

    # ---- forward -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device the tower's weights are on."""
        return self.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the tower's weights (pixels are cast to it)."""
        return self.patch_embed.proj.weight.dtype

    def num_tokens(self, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[int]:
        """Output tokens per item."""
        return [t * h * w // (self.merge * self.merge) for t, h, w in grid_list(grid_thw)]

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """Merged tokens of every item, in item order, from the packed patches and each item's (t, h, w) grid."""
        grid = grid_list(grid_thw)
        if self.cuda_graphs:  # a new forward: the graphs may reuse the last one's outputs, all consumed by now
            torch.compiler.cudagraph_mark_step_begin()
        n_patches = sum(t * h * w for t, h, w in grid)
        if pixel_values.shape[0] != n_patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw implies {n_patches}")
        device = self.device
        x = self._embed(pixel_values.to(device=device, dtype=self.dtype), grid)
        positions = vision_position_ids(grid, self.merge)
        plans, order = self._layout(grid, device)
        unit = self.merge * self.merge
        if order is not None:
            x = x.view(-1, unit, x.shape[-1])[order.to(device)].view(-1, x.shape[-1])
            positions = positions.view(-1, unit, 2)[order].view(-1, 2)
        cos, sin = vision_rotary_cos_sin(positions, self.head_dim, self.rope_theta, device)
        taps = []
        for index, (block, plan) in enumerate(zip(self.blocks, plans, strict=True)):
            x = block(x, cos, sin, plan)
            if index in self.tap_layers:
                taps.append(self._tap(index, x))
        out = self.merger(x)
        if taps:  # levels side by side on the last dimension, the merged tokens first
            out = torch.cat([out, *taps], dim=-1)
        if order is not None:
            out = out[torch.argsort(order).to(device)]
        return out.clone() if self.cuda_graphs else out  # the caller's own, not a graph's buffer

    def compile_parts(self) -> None:
        """`--compile inductor`: each block's parts around attention and the mergers compiled (layers/compiled.py),
        then one small forward so every graph is built now, before any request (one serves every token count)."""
        from eric_epd.models.layers.compiled import compile_methods

        start = time.perf_counter()
        compile_methods(self.blocks, ("attention_inputs", "finish"), self.device)
        compile_methods([m for m in self.modules() if isinstance(m, PatchMerger)], ("forward",), self.device)
        self.cuda_graphs = self.device.type == "cuda"
        side = 2 * self.merge  # two merge windows per side, as the engine's warm-up item
        self(torch.zeros(side * side, self.patch_embed.in_dim, device=self.device), [(1, side, side)])
        logger.info("compiled the vision tower in %.1fs", time.perf_counter() - start)

    # ---- weights -------------------------------------------------------------------------------------------
    @staticmethod
    def strip_prefix(name: str) -> str:
        """A checkpoint key without its vision-tower prefix (`VISION_PREFIXES`); other keys unchanged."""
        for prefix in VISION_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix) :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (name, tensor-or-safetensors-slice) pairs, names with or without the `visual.` /
        `model.visual.` prefix; each tensor is sliced to this rank's shard. Raises on unexpected names and,
        at the end, on any parameter left unloaded. Returns the loaded parameter names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            key = self.param_name(self.strip_prefix(name))
            if key.endswith(IGNORED_SUFFIXES):
                continue
            if key not in params:
                raise KeyError(f"unexpected vision weight {name!r} for {type(self).__name__}")
            if key in loaded:
                raise KeyError(f"vision weight {name!r} given twice")
            module = self.get_submodule(key.rpartition(".")[0])
            loader = getattr(module, "weight_loader", None)
            try:
                (loader or default_weight_loader)(params[key], tensor)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            loaded.add(key)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"{len(missing)} vision weights missing from the checkpoint, e.g. {missing[:5]}")
        for module in self.modules():  # rewrites that need the loaded weights (e.g. folded activation scales)
            if (after_load := getattr(module, "after_load", None)) is not None:
                after_load()
        logger.debug("loaded %d vision tensors (tp rank %d/%d)", len(loaded), self.tp.rank, self.tp.world_size)
        return loaded
