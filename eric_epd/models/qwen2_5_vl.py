"""Tensor-parallel Qwen2.5-VL vision tower: RMSNorm, gated SiLU MLP, windowed and full-attention blocks.

Builds on the Qwen2-VL encoder; only the norms, the MLP and the window layout differ.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from eric_epd.common.tower_defaults import QWEN2_5_VL
from eric_epd.models.layers.activations import get_activation
from eric_epd.models.layers.attention import VarlenPlan
from eric_epd.models.layers.parallel import ColumnParallelLinear, RowParallelLinear, TPContext
from eric_epd.models.qwen2_vl import Grid, Qwen2VLVisionEncoder, frame_cu_seqlens

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (as HF's Qwen2_5_VLRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """`x` RMS-normalized over its last dimension, in float32 (no weight applied)."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMS-normalize `x` in float32, then scale by the weight in `x`'s dtype."""
        return self.weight * self.normalized(x).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, dim: int, hidden: int, act: str, tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, hidden, True, tp, dtype)
        self.up_proj = ColumnParallelLinear(dim, hidden, True, tp, dtype)
        self.down_proj = RowParallelLinear(hidden, dim, True, tp, dtype)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) for this rank's hidden features, all-reduced by the row-parallel down."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def window_layout(grid: Grid, merge: int, window_size: int, patch_size: int) -> tuple[np.ndarray, list[int]]:
    """Merge-unit permutation that groups each frame's tokens by attention window (windows row-major, tokens
    row-major inside), and the cumulative window boundaries in patches, as HF's get_vision_window_index."""
    win = window_size // merge // patch_size
    if win < 1:
        raise ValueError(f"window_size {window_size} smaller than one merged patch ({merge * patch_size})")
    orders: list[np.ndarray] = []
    cu = [0]
    offset = 0
    for t, h, w in grid:
        lh, lw = h // merge, w // merge
        nh, nw = -(-lh // win), -(-lw // win)
        padded = np.full((t, nh * win, nw * win), -1, dtype=np.int64)
        padded[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw)
        windows = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(-1, win * win)
        valid = windows >= 0
        orders.append(windows[valid] + offset)
        cu.extend((np.cumsum(valid.sum(1)) * merge * merge + cu[-1]).tolist())
        offset += t * lh * lw
    order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
    return order, cu


class Qwen2_5_VLVisionEncoder(Qwen2VLVisionEncoder):  # noqa: N801 - HF naming
    """Qwen2.5-VL vision tower: same forward contract as Qwen2VLVisionEncoder."""

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, tp, dtype)
        self.window_size = int(self.cfg["window_size"])
        self.fullatt_block_indexes = frozenset(int(i) for i in self.cfg["fullatt_block_indexes"] or ())

    defaults: ClassVar[Mapping[str, Any]] = QWEN2_5_VL

    def _dims(self, cfg: dict[str, Any]) -> tuple[int, int]:
        return int(cfg["hidden_size"]), int(cfg["out_hidden_size"])

    def _make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, dtype=self.param_dtype)

    def _make_mlp(self) -> nn.Module:
        hidden = int(self.cfg["intermediate_size"])
        return GatedMLP(self.width, hidden, self.cfg["hidden_act"], self.tp, self.param_dtype)

    def _layout(self, grid: Grid, device: torch.device) -> tuple[list[VarlenPlan], torch.Tensor | None]:
        order, cu_window = window_layout(grid, self.merge, self.window_size, self.patch_size)
        full = VarlenPlan.build(frame_cu_seqlens(grid), device)
        windowed = VarlenPlan.build(cu_window, device)
        plans = [full if i in self.fullatt_block_indexes else windowed for i in range(self.depth)]
        return plans, torch.from_numpy(order)
