"""Eric's generic-path worker in process for model tests: a loaded runner, and a batch run as the engine hands it."""

from __future__ import annotations

from pathlib import Path

import torch

from eric_epd.eric.generic import GenericRunner, GenericWorkload
from eric_epd.eric.workload import encoder_workload, work_item
from eric_epd.models.facts import ModelFacts
from eric_epd.models.layers.parallel import TPContext
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.work import WorkItem


def generic_runner(ckpt: Path, dtype: str = "float32") -> tuple[GenericWorkload, GenericRunner]:
    """The checkpoint's generic workload and its TP-1 runner on the CPU."""
    config = RuntimeConfig(model=ckpt, dtype=dtype, device="cpu")
    workload = encoder_workload(config, ModelFacts.from_checkpoint(ckpt))
    assert isinstance(workload, GenericWorkload)
    return workload, workload.load(config, torch.device("cpu"), TPContext())


def run_batch(workload: GenericWorkload, runner: GenericRunner, items: list) -> list[torch.Tensor]:
    """A batch as the engine hands it to a worker: validated work items, their frames concatenated (float32)."""
    work: list[WorkItem] = [work_item(f"item{i}", it, 0, 0) for i, it in enumerate(items)]
    for w, it in zip(work, items):
        assert workload.validate(w, it.pixel_values.nbytes) is None
    inputs = torch.cat([torch.from_numpy(it.pixel_values) for it in items])
    with torch.inference_mode():
        return runner.run(work, inputs)
