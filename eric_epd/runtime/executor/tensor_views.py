"""Tensors as the bytes a shared-memory slot holds and back, zero-copy where the layout allows (any dtype, bfloat16
too): what ShmBroadcast writes and what a worker reads its inputs as."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def tensor_to_buffer(t: torch.Tensor) -> memoryview:
    """Flat uint8 view of a CPU tensor's bytes (any dtype, bfloat16 too; copies only if non-contiguous)."""
    import torch

    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def buffer_to_tensor(
    buf: memoryview | bytes | bytearray, dtype: str | torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """Tensor of ``dtype`` (e.g. "bfloat16") and ``shape`` over ``buf``, zero-copy; it keeps ``buf`` mapped.

    Over a dequeue() view its data is valid only until release() (clone() to keep it), and it is shared
    with the other readers: treat it as read-only (PyTorch cannot enforce that)."""
    import torch

    tdtype = getattr(torch, str(dtype).removeprefix("torch."))  # "bfloat16", "torch.bfloat16" or a dtype
    arr = np.frombuffer(buf, np.uint8)  # holds a buffer export, so the mapping outlives the tensor
    with warnings.catch_warnings():  # read-only views: torch warns (once) but wraps them fine
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr).view(tdtype).reshape(tuple(shape))  # size mismatch: RuntimeError


def as_bytes(obj: Any) -> memoryview:
    """A flat, C-contiguous uint8 view of a bytes-like object, ndarray or CPU tensor."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and isinstance(obj, torch_mod.Tensor):
        return tensor_to_buffer(obj)
    arr = obj if isinstance(obj, np.ndarray) else np.asarray(memoryview(obj))  # no copy if contiguous
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
