"""What a server plugs into the shared skeleton: how the engine checks an item, how big a batch's inputs get, the
start-up batch, and the model each worker loads (Eric: a vision encoder; Geri: a diffusion generator)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.work import WorkItem

INPUT_BYTES = 4
"""The most bytes a value of an item's input takes across the processes (float32; uint8 levels take one)."""


class Runner(Protocol):
    """One worker's loaded model shard."""

    dtype: torch.dtype
    """Inputs are cast to this on the device before `run`."""

    def run(self, items: list[WorkItem], inputs: torch.Tensor) -> list[torch.Tensor]:
        """One output per item, from the batch's inputs concatenated flat (in item order, on the device)."""
        ...


class Workload(Protocol):
    """Picklable: the engine process and every worker get a copy at spawn."""

    def validate(self, item: WorkItem, input_nbytes: int) -> str | None:
        """Why the engine must refuse this item (400), or None."""
        ...

    def max_batch_input_bytes(self, config: RuntimeConfig) -> int:
        """The largest batch's inputs in bytes, so broadcast slots hold any batch the scheduler forms."""
        ...

    def warmup(self, config: RuntimeConfig) -> tuple[WorkItem, np.ndarray]:
        """A small item (and its float32 input) every rank runs before the server says it is ready."""
        ...

    def load(self, config: RuntimeConfig, device: torch.device, tp: object) -> Runner:
        """This rank's model on `device`; `tp` is the rank's TPContext."""
        ...
