"""A vision-only transformers model as Eric's encoder: a batch of HF processor outputs (images or videos) in, each
item's rows out."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch
from torch import nn

from eric_epd.models.hf.adapters import FamilyLayout, layout_for
from eric_epd.models.hf.loader import hf_config, load_vision_model

logger = logging.getLogger(__name__)


class HFVisionEncoder:
    """The model's own `get_image_features` (`get_video_features`) on named input tensors, its output laid out as
    vLLM's rows."""

    def __init__(self, model: nn.Module, model_type: str, width: int, dtype: torch.dtype) -> None:
        self.model = model
        self.layout: FamilyLayout = layout_for(model_type)
        self.width = width
        """Row width: the language model's hidden size (Qwen3-Omni: times 1 + its DeepStack levels)."""
        self.dtype = dtype
        """The dtype the model was loaded in: pixels go in and rows come out in it."""
        self.accepts = {modality: _named_params(getattr(model, f"get_{modality}_features", None))
                        for modality in ("image", "video")}
        """Per modality, the processor outputs its `get_*_features` takes (the others, e.g. num_crops, are left
        out); empty for a modality the model has no such method for."""

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> HFVisionEncoder:
        """The checkpoint's vision tower and projector, only their weights read."""
        config = hf_config(model_dir)
        return cls(load_vision_model(model_dir, dtype, device), config.model_type,
                   int(config.get_text_config().hidden_size), dtype)

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
        kwargs = {name: t.to(self.dtype) if t.is_floating_point() else t
                  for name, t in inputs.items() if name in accepts}
        out = getattr(self.model, method)(**kwargs, return_dict=True)
        layout = self.layout.rows if method == "get_image_features" else self.layout.video_rows
        flat = layout(self.model, out)
        if flat.dim() != 2 or flat.shape[0] != sum(rows) or flat.shape[1] != self.width:
            raise RuntimeError(f"the model gave rows of shape {list(flat.shape)}, expected [{sum(rows)}, {self.width}] "
                               f"for items of {rows} rows")
        return list(flat.to(self.dtype).split(rows))


def _named_params(method: object) -> frozenset[str]:
    """The named parameters of `method` (no **kwargs); empty for None."""
    if method is None:
        return frozenset()
    params = inspect.signature(method).parameters.values()  # type: ignore[arg-type]
    return frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
