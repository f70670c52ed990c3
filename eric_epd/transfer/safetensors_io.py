"""Embedding bytes as a one-tensor safetensors file (the body of GET /v1/embeddings/{hash}) and back."""

from __future__ import annotations

import json
import struct

import numpy as np

# safetensors dtype names for the dtypes an encoder emits
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "uint8": "U8"}


def safetensors_bytes(data: np.ndarray, shape: tuple[int, ...], dtype: str, name: str = "embedding") -> bytes:
    """One tensor named `name` in safetensors format (8-byte header length, JSON header, raw data)."""
    header = json.dumps(
        {name: {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [0, data.nbytes]}}
    ).encode()
    header += b" " * (-len(header) % 8)  # the format wants the data 8-byte aligned
    return struct.pack("<Q", len(header)) + header + data.tobytes()


def safetensors_payload(body: bytes) -> memoryview:
    """The data bytes of a one-tensor safetensors file."""
    (header_len,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + header_len])
    (meta,) = [v for k, v in header.items() if k != "__metadata__"]
    start, end = meta["data_offsets"]
    return memoryview(body)[8 + header_len + start : 8 + header_len + end]
