"""The activation functions the vision towers' configs name (`hidden_act`), looked up by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F

QUICK_GELU_SCALE = 1.702


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), as HF's QuickGELUActivation."""
    return x * torch.sigmoid(QUICK_GELU_SCALE * x)


def silu_inplace(x: torch.Tensor) -> torch.Tensor:
    """SiLU written over its input (for intermediates nothing else reads)."""
    return F.silu(x, inplace=True)


ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType(
    {
        "quick_gelu": quick_gelu,
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }
)


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a vision config names, from `ACTIVATIONS`; ValueError for an unknown one."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
