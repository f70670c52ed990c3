"""Tensor-parallel Qwen3-VL vision tower (also Qwen3-VL-MoE's): Qwen2-VL's blocks with a biased patch embedding,
learned position embeddings resampled to each grid, and DeepStack mergers whose outputs sit beside the merged tokens.

Output rows are [merged | level 1 | ... | level k] on the last dimension, the layout vLLM's own encoder produces.
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from eric_epd.models.layers.parallel import TPContext, copy_into, read_full
from eric_epd.models.qwen2_vl import Grid, LayerNorm, PatchEmbed, PatchMerger, Qwen2VLVisionEncoder, VisionMLP

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
    index = torch.stack([h0[:, None] * side + w0[None, :], h0[:, None] * side + w1[None, :],
                         h1[:, None] * side + w0[None, :], h1[:, None] * side + w1[None, :]])
    weight = torch.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw])
    order = torch.arange(h * w).view(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).reshape(-1)
    return index.reshape(4, -1)[:, order].contiguous(), weight.reshape(4, -1)[:, order].contiguous()


class Qwen3VLVisionEncoder(Qwen2VLVisionEncoder):
    """forward(pixel_values, grid_thw) -> (P // merge**2, out_hidden_size * (1 + DeepStack levels))."""

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, tp, dtype)
        cfg = self.cfg
        self.patch_embed = PatchEmbed(self.in_channels, self.temporal_patch_size, self.patch_size, self.width, dtype,
                                      bias=True)
        num = int(cfg.get("num_position_embeddings", 2304))
        self.side = math.isqrt(num)
        if self.side * self.side != num:
            raise ValueError(f"num_position_embeddings {num} is not a square")
        self.pos_embed = PositionTable(num, self.width, dtype)
        indexes = [int(i) for i in cfg.get("deepstack_visual_indexes") or ()]
        self.tap_layers = frozenset(indexes)
        self._tap_level = {layer: level for level, layer in enumerate(indexes)}
        self.deepstack_merger_list = nn.ModuleList([
            PatchMerger(LayerNorm(self.width * self.merge**2, dtype=dtype), self.width, self.out_dim, self.merge,
                        self.tp, dtype, postshuffle=True)
            for _ in indexes
        ])
        self.out_width = self.out_dim * (1 + len(indexes))

    def _dims(self, cfg: dict[str, Any]) -> tuple[int, int]:
        return int(cfg.get("hidden_size", 1152)), int(cfg.get("out_hidden_size", 3584))

    def _make_mlp(self) -> nn.Module:
        hidden = int(self.cfg.get("intermediate_size", 4304))
        return VisionMLP(self.width, hidden, self.cfg.get("hidden_act", "gelu_pytorch_tanh"), self.tp,
                         self.param_dtype)

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
