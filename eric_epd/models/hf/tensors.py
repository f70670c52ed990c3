"""An item's named processor tensors packed into one flat float32 frame (the form every item's input crosses the
processes in) and unpacked on the worker by the (name, shape, dtype) list that travels in its spec."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

EXACT_INT = 1 << 24
"""Integers up to this magnitude survive the float32 frame exactly."""


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of an item's frame, in frame order."""

    name: str
    """The processor's output name (pixel_values, image_sizes, pixel_attention_mask, image_grid_thw, ...)."""
    shape: tuple[int, ...]
    dtype: str
    """The processor's torch dtype, without "torch." (float32, bfloat16, int64, bool, ...)."""

    @property
    def numel(self) -> int:
        """Values in the tensor."""
        return math.prod(self.shape)


def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
    """The specs of `tensors` (in their order) and their values as one flat float32 array. ValueError for an integer
    tensor float32 cannot hold exactly."""
    specs, parts = [], []
    for name, tensor in tensors.items():
        integer = not (tensor.is_floating_point() or tensor.dtype == torch.bool)
        if integer and tensor.numel() and int(tensor.abs().max()) > EXACT_INT:
            raise ValueError(f"{name} holds integers above {EXACT_INT}: not exact as float32")
        specs.append(TensorSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
        parts.append(tensor.detach().to(torch.float32).reshape(-1).numpy())
    frame = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return tuple(specs), np.ascontiguousarray(frame, dtype=np.float32)


def unpack_tensors(specs: tuple[TensorSpec, ...], frame: torch.Tensor) -> dict[str, torch.Tensor]:
    """The named tensors of one item's flat frame (views where the dtype is float32); floating tensors stay
    float32 (the model casts them), the others get their own dtype back."""
    if frame.numel() != sum(s.numel for s in specs):
        raise ValueError(f"a frame of {frame.numel()} values for tensors of {sum(s.numel for s in specs)}")
    out = {}
    for spec, part in zip(specs, frame.split([s.numel for s in specs])):
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{spec.name}: unknown dtype {spec.dtype!r}")
        part = part.view(spec.shape)
        out[spec.name] = part if dtype.is_floating_point else part.to(dtype)
    return out


def signature(specs: tuple[TensorSpec, ...]) -> str:
    """What items must share to run in one forward: every tensor's name and shape past dim 0 (items are joined along
    dim 0, as the processor batches them)."""
    return ",".join(f"{s.name}:{'x'.join(map(str, s.shape[1:]))}" for s in specs)


def join_items(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Items of one signature as one batch: each tensor concatenated along dim 0."""
    return {name: torch.cat([item[name] for item in items]) if len(items) > 1 else items[0][name] for name in items[0]}
