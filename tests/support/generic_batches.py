"""Eric's generic-path worker in process for model tests: a loaded runner, a batch run as the engine hands it, the
check that items alone and batched give reference rows, and a tower of Eric's own at TP 2 over gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def assert_alone_and_batched(
    workload: GenericWorkload, runner: GenericRunner, items: list, refs: list[torch.Tensor], rtol: float
) -> None:
    """Each item's rows alone (float32), then all of them in one batch, equal the references within `rtol`."""
    assert [it.num_tokens for it in items] == [r.shape[0] for r in refs]
    for item, ref in zip(items, refs):
        (alone,) = run_batch(workload, runner, [item])
        assert alone.shape == ref.shape and alone.dtype == torch.float32
        assert relative_error(alone, ref) <= rtol
    for i, (ours, ref) in enumerate(zip(run_batch(workload, runner, items), refs)):
        assert ours.shape == ref.shape, i
        assert relative_error(ours, ref) <= rtol, i


Job = tuple[str, dict[str, torch.Tensor], list[int]]
"""A batch for a tower encoder: its modality, its items' joined tensors, each item's rows."""


def joined_job(modality: str, items: list) -> Job:
    """Processed items of one modality as one batch (their tensors joined along dim 0, as the runner joins them)."""
    from eric_epd.models.hf.tensors import join_items, unpack_tensors

    joined = join_items([unpack_tensors(it.tensors, torch.from_numpy(it.pixel_values)) for it in items])
    return modality, joined, [it.num_tokens for it in items]


def tower_tp2(
    encoder_class: Any, model_dir: Path, jobs: dict[str, Job], shards: dict[str, str], out_dir: Path
) -> list[dict[str, Any]]:
    """Per rank of two gloo ranks (spawned processes, each loading its own shard of `encoder_class`'s tower from
    `model_dir` in float32): each job's rows under its name, and under each name of `shards` the tower parameter at
    that path (the rank's shard of it)."""
    import torch.multiprocessing as mp

    from tests.support.tp_spawn import rendezvous

    mp.spawn(
        _tp_worker,
        args=(2, rendezvous(out_dir), encoder_class, str(model_dir), jobs, shards, str(out_dir)),
        nprocs=2,
        join=True,
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _tp_worker(
    rank: int,
    world: int,
    init: str,
    encoder_class: Any,
    model_dir: str,
    jobs: dict[str, Job],
    shards: dict[str, str],
    out_dir: str,
) -> None:
    import torch.distributed as dist

    from tests.support.tp_spawn import leave_at_once

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        encoder = encoder_class.load(model_dir, torch.float32, "cpu", TPContext(rank, world))
        out = {name: encoder.encode(inputs, rows, modality) for name, (modality, inputs, rows) in jobs.items()}
        out |= {name: encoder.tower.get_parameter(path) for name, path in shards.items()}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave_at_once()  # its results are saved: no teardown in this process (tests/support/tp_spawn.py)
