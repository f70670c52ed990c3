"""The vision towers' two-layer MLP: fc1 column-parallel, the config's activation, fc2 row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from eric_epd.models.layers.activations import QUICK_GELU_SCALE, get_activation, silu_inplace
from eric_epd.models.layers.parallel import ColumnParallelLinear, RowParallelLinear, TPContext


class VisionMLP(nn.Module):
    """fc1 (column) -> activation -> fc2 (row)."""

    def __init__(self, dim: int, hidden: int, act: str, tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, True, tp, dtype)
        self.fc2 = RowParallelLinear(hidden, dim, True, tp, dtype)
        self.act_name = act
        self.act = get_activation(act)

    def after_load(self) -> None:
        """float32 quick_gelu: x*sigmoid(1.702x) = silu(1.702x)/1.702, so 1.702 goes into fc1 and 1/1.702 into
        fc2's weight and the activation becomes one in-place pass (three passes and two allocations before).
        Lower-precision weights are left as they are (scaling them would round them again)."""
        if self.act_name != "quick_gelu" or self.fc1.weight.dtype not in (torch.float32, torch.float64):
            return
        with torch.no_grad():
            self.fc1.weight.mul_(QUICK_GELU_SCALE)
            self.fc1.bias.mul_(QUICK_GELU_SCALE)
            self.fc2.weight.div_(QUICK_GELU_SCALE)
        self.act_name, self.act = "silu_folded", silu_inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fc2(act(fc1(x))) for this rank's hidden features, all-reduced by the row-parallel fc2."""
        return self.fc2(self.act(self.fc1(x)))
