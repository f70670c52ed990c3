"""What the generic path's transformers encoders (images and videos, audio) share: loading the checkpoint's model
without its language model, and checking a batch's rows before splitting them into items."""

from __future__ import annotations

from pathlib import Path
from typing import Self

import torch
from torch import nn

from eric_epd.models.hf.loader import hf_config, load_vision_model


class HFEncoder:
    """A transformers model behind Eric's encoder interface; a subclass writes `encode` (the model's own call)."""

    def __init__(self, model: nn.Module, model_type: str, width: int, dtype: torch.dtype) -> None:
        self.model = model
        self.model_type = model_type
        self.width = width
        """Row width: the language model's hidden size (Qwen3-Omni's vision rows: times 1 + its DeepStack levels)."""
        self.dtype = dtype
        """The dtype the model was loaded in: inputs go in and rows come out in it."""

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> Self:
        """The checkpoint's towers and projector (the language model never built), only their weights read."""
        config = hf_config(model_dir)
        return cls(
            load_vision_model(model_dir, dtype, device),
            config.model_type,
            int(config.get_text_config().hidden_size),
            dtype,
        )

    def split_rows(self, flat: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """The batch's [sum(rows), width] output as each item's rows, in the model's dtype; RuntimeError for any
        other shape."""
        if flat.dim() != 2 or flat.shape[0] != sum(rows) or flat.shape[1] != self.width:
            raise RuntimeError(
                f"the model gave rows of shape {list(flat.shape)}, expected [{sum(rows)}, {self.width}] "
                f"for items of {rows} rows"
            )
        return list(flat.to(self.dtype).split(rows))
