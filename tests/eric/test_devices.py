"""The GPU-path rules that need no GPU: which device each tensor-parallel rank takes, against a stated device
count (the count is the only stand-in; nothing here touches CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eric_epd.eric.config import EricConfig


def test_each_rank_takes_its_own_device_and_too_many_ranks_fail_at_start() -> None:
    cuda = EricConfig(model=Path("."), tp_size=2, device="cuda")
    assert [cuda.rank_device(r, device_count=2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert cuda.rank_device(1, device_count=8) == "cuda:1"
    with pytest.raises(ValueError, match="--tp 2 needs 2 CUDA devices, 1 visible"):
        cuda.rank_device(0, device_count=1)  # no two ranks on one device
    cpu = EricConfig(model=Path("."), tp_size=4, device="cpu")
    assert {cpu.rank_device(r, device_count=0) for r in range(4)} == {"cpu"}


def test_broadcast_slots_hold_the_largest_batch(qwen2_vl_tiny: Path) -> None:
    """A full batch never spills: on CUDA (32768 patches of 3x2x14x14 float32 for the real patch size) a slot
    holds ~154 MB of pixels; on CPU the 4096-patch cap fits the default 32 MiB slots."""
    from eric_epd.eric.workload import EncoderWorkload
    from eric_epd.models.facts import ModelFacts
    from eric_epd.models.registry import read_model_config
    from eric_epd.runtime.executor.executor import broadcast_geometry

    vision = read_model_config(qwen2_vl_tiny)["vision_config"]
    row = vision.get("in_chans", 3) * vision.get("temporal_patch_size", 2) * vision["patch_size"] ** 2
    workload = EncoderWorkload.from_facts(ModelFacts.from_checkpoint(qwen2_vl_tiny))
    assert workload.pixel_row == row and workload.merge_unit == vision["spatial_merge_size"] ** 2
    cpu = broadcast_geometry(workload.max_batch_input_bytes(EricConfig(model=qwen2_vl_tiny, device="cpu")))
    assert cpu == {"n_slots": 4, "slot_bytes": 32 << 20} and 4096 * row * 4 < 32 << 20
    cuda = broadcast_geometry(workload.max_batch_input_bytes(EricConfig(model=qwen2_vl_tiny, device="cuda")))
    assert cuda["slot_bytes"] >= 32768 * row * 4 + (1 << 20) and cuda["n_slots"] >= 2
