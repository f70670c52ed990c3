"""Eric's generic-path worker in process for model tests: a loaded runner, a batch run as the engine hands it, and
the check that items alone and batched give reference rows."""

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


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def assert_alone_and_batched(workload: GenericWorkload, runner: GenericRunner, items: list,
                             refs: list[torch.Tensor], rtol: float) -> None:
    """Each item's rows alone (float32), then all of them in one batch, equal the references within `rtol`."""
    assert [it.num_tokens for it in items] == [r.shape[0] for r in refs]
    for item, ref in zip(items, refs):
        (alone,) = run_batch(workload, runner, [item])
        assert alone.shape == ref.shape and alone.dtype == torch.float32
        assert relative_error(alone, ref) <= rtol
    for i, (ours, ref) in enumerate(zip(run_batch(workload, runner, items), refs)):
        assert ours.shape == ref.shape, i
        assert relative_error(ours, ref) <= rtol, i
