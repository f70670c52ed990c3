"""Tensor-parallel Qwen3-VL vision tower (also Qwen3-VL-MoE's): Qwen2-VL's blocks with a biased patch embedding,
learned position embeddings resampled to each grid, and DeepStack mergers whose outputs sit beside the merged tokens.

Output rows are [merged | level 1 | ... | level k] on the last dimension, the layout vLLM's own encoder produces.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, ClassVar

import torch
from torch import nn

from eric_epd.common.tower_defaults import QWEN3_5, QWEN3_VL
from eric_epd.models.layers.mlp import VisionMLP
from eric_epd.models.layers.parallel import TPContext, copy_into, read_full
from eric_epd.models.qwen2_vl import Grid, LayerNorm, PatchEmbed, PatchMerger, Qwen2VLVisionEncoder

logger = logging.getLogger(__name__)

_RENAMES = (  # Hugging Face's Qwen3-VL names -> the shared modules' names
    (re.compile(r"^(blocks\.\d+\.mlp)\.linear_fc(\d)\."), r"\1.fc\2."),
    (re.compile(r"^(merger|deepstack_merger_list\.\d+)\.norm\."), r"\1.ln_q."),
    (re.compile(r"^(merger|deepstack_merger_list\.\d+)\.linear_fc1\."), r"\1.mlp.0."),
    (re.compile(r"^(merger|deepstack_merger_list\.\d+)\.linear_fc2\."), r"\1.mlp.2."),
)


class PositionTable(nn.Module):
    """The learned (side x side) position table, replicated on every rank."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: torch.Tensor, full: Any) -> None:
        """Load the whole table on every rank."""
        copy_into(param, read_full(full))


@lru_cache(maxsize=256)
def _bilinear_taps(h: int, w: int, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(4, h*w) table indices and float32 weights that resample the table to an h x w grid (bilinear,
    align_corners), rows in the processor's merge-block order, as HF's and vLLM's Qwen3-VL."""
    hs, ws = torch.linspace(0, side - 1, h), torch.linspace(0, side - 1, w)
    h0, w0 = hs.long(), ws.long()
    h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
    dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
    index = torch.stack(
        [
            h0[:, None] * side + w0[None, :],
            h0[:, None] * side + w1[None, :],
            h1[:, None] * side + w0[None, :],
            h1[:, None] * side + w1[None, :],
        ]
    )
    weight = torch.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw])
    order = torch.arange(h * w).view(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).reshape(-1)
    return index.reshape(4, -1)[:, order].contiguous(), weight.reshape(4, -1)[:, order].contiguous()


class Qwen3VLVisionEncoder(Qwen2VLVisionEncoder):
    """forward(pixel_values, grid_thw) -> (P // merge**2, out_hidden_size * (1 + DeepStack levels))."""

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, tp, dtype)
        cfg = self.cfg
        self.patch_embed = PatchEmbed(
            self.in_channels, self.temporal_patch_size, self.patch_size, self.width, dtype, bias=True
        )
        num = int(cfg["num_position_embeddings"])
        self.side = math.isqrt(num)  # transformers: int(num ** 0.5); a non-square table reads its first side**2 rows
        if self.side < 1:
            raise ValueError(f"num_position_embeddings {num}: no position grid")
        self.pos_embed = PositionTable(num, self.width, dtype)
        indexes = [int(i) for i in cfg.get("deepstack_visual_indexes") or ()]
        if len(set(indexes)) != len(indexes) or not set(indexes) <= set(range(self.depth)):
            raise ValueError(f"deepstack_visual_indexes {indexes}: each block of the {self.depth} once at most")
        self.tap_layers = frozenset(indexes)
        self._tap_level = {layer: level for level, layer in enumerate(indexes)}
        self.deepstack_merger_list = nn.ModuleList(
            [
                PatchMerger(
                    LayerNorm(self.width * self.merge**2, dtype=dtype),
                    self.width,
                    self.out_dim,
                    self.merge,
                    self.tp,
                    dtype,
                    postshuffle=True,
                )
                for _ in indexes
            ]
        )
        self.out_width = self.out_dim * (1 + len(indexes))

    defaults: ClassVar[Mapping[str, Any]] = QWEN3_VL

    def _dims(self, cfg: dict[str, Any]) -> tuple[int, int]:
        return int(cfg["hidden_size"]), int(cfg["out_hidden_size"])

    def _make_mlp(self) -> nn.Module:
        hidden = int(self.cfg["intermediate_size"])
        return VisionMLP(self.width, hidden, self.cfg["hidden_act"], self.tp, self.param_dtype)

    def _embed(self, pixels: torch.Tensor, grid: Grid) -> torch.Tensor:
        x = self.patch_embed(pixels)
        table = self.pos_embed.weight
        parts = []
        for t, h, w in grid:
            index, weight = _bilinear_taps(h, w, self.side, self.merge)
            rows = (table[index.to(table.device)].float() * weight.to(table.device)[:, :, None]).sum(0)
            parts.append(rows.repeat(t, 1))
        return x + torch.cat(parts).to(x.dtype)

    def _tap(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self.deepstack_merger_list[self._tap_level[index]](x)

    @staticmethod
    def param_name(key: str) -> str:
        """A Qwen3-VL checkpoint key (prefix stripped) renamed to the shared modules' parameter name (`_RENAMES`)."""
        for pattern, repl in _RENAMES:
            key = pattern.sub(repl, key)
        return key


class Qwen3_5VisionEncoder(Qwen3VLVisionEncoder):  # noqa: N801 - HF naming
    """Qwen3.5's (and Qwen3.5-MoE's) vision tower: Qwen3-VL's, whose config's defaults have no DeepStack levels."""

    defaults: ClassVar[Mapping[str, Any]] = QWEN3_5
