"""A vision-only transformers model as Eric's encoder: a batch of HF processor outputs in, each item's rows out."""

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
    """The model's own `get_image_features` on named input tensors, its output laid out as vLLM's rows."""

    def __init__(self, model: nn.Module, model_type: str, width: int, dtype: torch.dtype) -> None:
        self.model = model
        self.layout: FamilyLayout = layout_for(model_type)
        self.width = width
        """Row width: the language model's hidden size."""
        self.dtype = dtype
        """The dtype the model was loaded in: pixels go in and rows come out in it."""
        params = inspect.signature(model.get_image_features).parameters.values()
        self.accepts = frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
        """The processor outputs `get_image_features` takes (the others, e.g. num_crops, are left out)."""

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> HFVisionEncoder:
        """The checkpoint's vision tower and projector, only their weights read."""
        config = hf_config(model_dir)
        return cls(load_vision_model(model_dir, dtype, device), config.model_type,
                   int(config.get_text_config().hidden_size), dtype)

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
        """Each item's [rows, width] output, for a batch whose tensors hold the items one after another along dim 0
        (as the processor would have batched them); floating inputs are cast to the model's dtype."""
        kwargs = {name: t.to(self.dtype) if t.is_floating_point() else t
                  for name, t in inputs.items() if name in self.accepts}
        out = self.model.get_image_features(**kwargs, return_dict=True)
        flat = self.layout.rows(self.model, out)
        if flat.dim() != 2 or flat.shape[0] != sum(rows) or flat.shape[1] != self.width:
            raise RuntimeError(f"the model gave rows of shape {list(flat.shape)}, expected [{sum(rows)}, {self.width}] "
                               f"for items of {rows} rows")
        return list(flat.to(self.dtype).split(rows))
