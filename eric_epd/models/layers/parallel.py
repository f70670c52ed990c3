"""Tensor-parallel linear layers (column, row, fused QKV) whose weight loaders slice checkpoint tensors.

Weights may be given as full tensors or as safetensors slices; either way only this rank's shard is copied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPContext:
    """This process's place in the tensor-parallel group; `group` None means the default process group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad TP rank {self.rank} of world size {self.world_size}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group in place (no-op at world size 1) and return it."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def shard(self, total: int, what: str = "dimension") -> int:
        """Size of this rank's equal share of `total`, failing loudly when it does not divide."""
        if total % self.world_size:
            raise ValueError(f"{what} {total} is not divisible by tensor-parallel size {self.world_size}")
        return total // self.world_size


def read_rows(src: Any, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a tensor or safetensors slice (dim 0), reading only those rows from a slice."""
    return src.narrow(0, start, stop - start) if isinstance(src, torch.Tensor) else src[start:stop]


def read_cols(src: Any, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) (dim 1) of a 2-D tensor or safetensors slice."""
    return src.narrow(1, start, stop - start) if isinstance(src, torch.Tensor) else src[:, start:stop]


def read_full(src: Any) -> torch.Tensor:
    """The whole tensor behind a tensor or safetensors slice."""
    return src if isinstance(src, torch.Tensor) else src[:]


def shape_of(src: Any) -> tuple[int, ...]:
    """Shape of a tensor or safetensors slice."""
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str = "") -> None:
    """Copy `value` into `param` (casting dtype/device), failing loudly on a shape mismatch."""
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"shape mismatch loading {name or 'parameter'}: {tuple(value.shape)} into {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value)


def default_weight_loader(param: torch.Tensor, src: Any) -> None:
    """Replicated parameter: copy the whole tensor."""
    copy_into(param, read_full(src))


class _ParallelLinear(nn.Module):
    """Weight (out_local, in_local) and optional bias; `weight_loader(param, full)` fills either."""

    def __init__(
        self, out_local: int, in_local: int, bias_size: int | None, tp: TPContext, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(bias_size, dtype=dtype), requires_grad=False) if bias_size is not None else None
        )

    def weight_loader(self, param: torch.Tensor, full: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    """y_local = x W_r^T + b_r: each rank owns a contiguous block of output features (no communication)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPContext, dtype: torch.dtype | None = None
    ) -> None:
        self.out_local = tp.shard(out_features, "output features")
        super().__init__(self.out_local, in_features, self.out_local if bias else None, tp, dtype)

    def weight_loader(self, param: torch.Tensor, full: Any) -> None:
        """Load this rank's block of output rows from the full checkpoint tensor."""
        start = self.tp.rank * self.out_local
        copy_into(param, read_rows(full, start, start + self.out_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features of `x` (no communication)."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """y = sum_r x_r W_r^T + b: each rank owns a block of input features; all-reduce, then bias once."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPContext, dtype: torch.dtype | None = None
    ) -> None:
        self.in_local = tp.shard(in_features, "input features")
        super().__init__(out_features, self.in_local, out_features if bias else None, tp, dtype)

    def weight_loader(self, param: torch.Tensor, full: Any) -> None:
        """Load this rank's block of input columns (the bias whole, on every rank)."""
        if param is self.bias:
            copy_into(param, read_full(full))
            return
        start = self.tp.rank * self.in_local
        copy_into(param, read_cols(full, start, start + self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output: each rank's partial product all-reduced, then the bias added once."""
        if self.tp.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class QKVParallelLinear(_ParallelLinear):
    """Fused qkv of shape (3*D, D) laid out [q; k; v]; each rank keeps [q_r; k_r; v_r] for its heads."""

    def __init__(
        self, hidden: int, num_heads: int, bias: bool, tp: TPContext, dtype: torch.dtype | None = None
    ) -> None:
        self.num_heads_local = tp.shard(num_heads, "attention heads")
        self.head_dim = hidden // num_heads
        self.hidden = hidden
        self.local = self.num_heads_local * self.head_dim
        super().__init__(3 * self.local, hidden, 3 * self.local if bias else None, tp, dtype)

    def weight_loader(self, param: torch.Tensor, full: Any) -> None:
        """Load this rank's heads of q, k and v from the fused checkpoint tensor, stacked as [q_r; k_r; v_r]."""
        if shape_of(full)[0] != 3 * self.hidden:
            raise ValueError(f"fused qkv expects {3 * self.hidden} rows, got {shape_of(full)}")
        start = self.tp.rank * self.local
        parts = [read_rows(full, j * self.hidden + start, j * self.hidden + start + self.local) for j in range(3)]
        copy_into(param, torch.cat(parts, dim=0))

    def load_part(self, param: torch.Tensor, src: Any, part: int) -> None:
        """Load this rank's heads of a checkpoint's separate q (part 0), k (1) or v (2) weight or bias."""
        start = self.tp.rank * self.local
        copy_into(param.narrow(0, part * self.local, self.local), read_rows(src, start, start + self.local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's q, k and v features of `x`."""
        return F.linear(x, self.weight, self.bias)
