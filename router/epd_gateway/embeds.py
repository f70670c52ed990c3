"""Client embeddings, for operators who opt in (`--allow-client-embeddings MODEL_DIR`): each `image_embeds` /
`video_embeds` part is decoded (numpy without pickle, or torch with weights_only) and must be [rows, width] with
rows fixed by its grid and width the model's real embedding width (DeepStack levels included)."""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eric_epd.common.errors import ApiError
from eric_epd.wire.handoff import embedding_width

_NUMPY_MAGIC = b"\x93NUMPY"
MAX_GRID = 1 << 16


@dataclass(frozen=True)
class EmbeddingShape:
    """What the model's own encoder hands its language model per merged token."""

    width: int
    merge: int

    @classmethod
    def from_checkpoint(cls, model_dir: Path) -> EmbeddingShape:
        """The width (hidden size times one plus the DeepStack levels) and merge size from the checkpoint's config."""
        cfg = json.loads((model_dir / "config.json").read_text())
        return cls(embedding_width(cfg), int(cfg.get("vision_config", {}).get("spatial_merge_size", 2)))

    def rows(self, grid: list[int]) -> int:
        """Merged tokens of an item of (t, h, w) patches."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)


def check_embeds_parts(body: dict[str, Any], shape: EmbeddingShape) -> None:
    """400 for any embeds part whose tensor does not fit its grid and the model."""
    for m, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type")
            if kind in ("image_embeds", "video_embeds"):
                _check_part(part.get(kind), kind, shape, f"messages[{m}].content[{p}]")


def _check_part(payload: Any, kind: str, shape: EmbeddingShape, where: str) -> None:
    grid_key = kind.replace("_embeds", "_grid_thw")
    if not isinstance(payload, dict) or set(payload) != {kind, grid_key}:
        raise ApiError(
            400, f"{where}: '{kind}' must be {{'{kind}': <base64 tensor>, '{grid_key}': [t, h, w]}}", param=kind
        )
    grid = payload[grid_key]
    if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(v, int) and 0 < v <= MAX_GRID for v in grid)):
        raise ApiError(400, f"{where}: '{grid_key}' must be three positive integers", param=grid_key)
    if any(v % shape.merge for v in grid[1:]):
        raise ApiError(
            400, f"{where}: '{grid_key}' {grid} is not a multiple of the merge size {shape.merge}", param=grid_key
        )
    dims = _tensor_shape(payload[kind], where, kind)
    want = [shape.rows(grid), shape.width]
    if dims != want:
        raise ApiError(400, f"{where}: '{kind}' is {dims}; its grid {grid} and this model need {want}", param=kind)


def _tensor_shape(data: Any, where: str, kind: str) -> list[int]:
    """Shape of a base64 tensor (numpy .npy without pickle, or torch.save read with weights_only)."""
    if not isinstance(data, str):
        raise ApiError(400, f"{where}: '{kind}' must be a base64 string", param=kind)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"{where}: '{kind}' is not valid base64: {e}", param=kind) from e
    try:
        if raw[:6] == _NUMPY_MAGIC:
            import numpy as np

            array = np.load(io.BytesIO(raw), allow_pickle=False)
            return list(array.shape) if array.dtype.kind == "f" else []
        import torch

        tensor = torch.load(io.BytesIO(raw), weights_only=True)
        if not isinstance(tensor, torch.Tensor) or tensor.is_sparse or not tensor.is_floating_point():
            return []
        return list(tensor.shape)
    except Exception as e:  # any undecodable payload is the client's error, never the gateway's
        raise ApiError(
            400, f"{where}: '{kind}' is not a float tensor (.npy or torch.save): {type(e).__name__}", param=kind
        ) from e
