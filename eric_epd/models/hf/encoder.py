"""A vision-only transformers model as Eric's encoder: a batch of HF processor outputs (images or videos) in, each
item's rows out."""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from eric_epd.models.hf.adapters import FamilyLayout, layout_for
from eric_epd.models.hf.base import HFEncoder

logger = logging.getLogger(__name__)


class HFVisionEncoder(HFEncoder):
    """The model's own `get_image_features` (`get_video_features`) on named input tensors, its output laid out as
    vLLM's rows."""

    def __init__(self, model: nn.Module, model_type: str, width: int, dtype: torch.dtype) -> None:
        super().__init__(model, model_type, width, dtype)
        self.layout: FamilyLayout = layout_for(model_type)
        self.accepts = {
            modality: _named_params(getattr(model, f"get_{modality}_features", None)) for modality in ("image", "video")
        }
        """Per modality, the processor outputs its `get_*_features` takes (the others, e.g. num_crops, are left
        out); empty for a modality the model has no such method for."""

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "image") -> list[torch.Tensor]:
        """Each item's [rows, width] output, for a batch of one modality whose tensors hold the items one after
        another along dim 0 (as the processor would have batched them); floating inputs are cast to the model's
        dtype."""
        if modality == "video" and not self.accepts["video"] & inputs.keys():
            modality = "image"  # a video's frames laid out as images (InternVL's tiles, Gemma 4's frames), as in vLLM
        accepts = self.accepts.get(modality)
        method = f"get_{modality}_features"
        if not accepts:
            raise RuntimeError(f"the model has no {method}")
        kwargs = {
            name: t.to(self.dtype) if t.is_floating_point() else t for name, t in inputs.items() if name in accepts
        }
        out = getattr(self.model, method)(**kwargs, return_dict=True)
        layout = self.layout.rows if method == "get_image_features" else self.layout.video_rows
        return self.split_rows(layout(self.model, out), rows)


def _named_params(method: object) -> frozenset[str]:
    """The named parameters of `method` (no **kwargs); empty for None."""
    if method is None:
        return frozenset()
    params = inspect.signature(method).parameters.values()  # type: ignore[arg-type]
    return frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
