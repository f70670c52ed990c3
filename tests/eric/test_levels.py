"""Qwen-VL pixels cross the processes as uint8 levels and are normalized on the worker's device: the tower's rows
equal its rows on transformers' own float32 pixel_values, other normalization settings give other rows, and the
engine and the device hand-off refuse what does not fit."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor

from eric_epd.eric.workload import EncoderRunner, EncoderWorkload, EncodeSpec, Levels, work_item
from eric_epd.media.synthetic import random_image
from eric_epd.models.facts import ModelFacts
from eric_epd.models.registry import load_encoder, load_processor
from eric_epd.runtime.config import BatchLimits
from eric_epd.runtime.engine.engine import Engine
from eric_epd.runtime.engine.messages import WorkRequestMsg
from eric_epd.runtime.executor.device_io import DeviceIO
from eric_epd.runtime.work import WorkItem, pack_spec
from tests.support.helpers_engine import InstantExecutor

SIZES = ((224, 168), (300, 200), (97, 131))


def _runner(ckpt: Path) -> EncoderRunner:
    return EncoderRunner(load_encoder(ckpt, torch.float32, "cpu"), torch.float32, 4, torch.float32)


def test_tower_rows_from_levels_equal_its_rows_on_transformers_pixels(qwen2_vl_tiny: Path) -> None:
    processor, runner = load_processor(qwen2_vl_tiny), _runner(qwen2_vl_tiny)
    hf = AutoImageProcessor.from_pretrained(qwen2_vl_tiny, backend="torchvision")
    images = [random_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    items = [processor.process_image(image) for image in images]
    assert all(it.pixel_values.dtype == np.uint8 for it in items)
    work = [work_item(str(i), it, 0, 0) for i, it in enumerate(items)]
    assert {w.input_dtype for w in work} == {"uint8"}
    levels = torch.cat([torch.from_numpy(it.pixel_values) for it in items])
    ours = runner.run(work, levels)
    theirs = hf(images=images, return_tensors="pt")
    with torch.no_grad():
        reference = runner.encoder(theirs["pixel_values"], theirs["image_grid_thw"])
    torch.testing.assert_close(torch.cat(ours), reference, rtol=0, atol=0)
    # negative control: the same levels under another checkpoint's normalization give other rows
    spec = msgspec.msgpack.decode(work[0].spec, type=EncodeSpec)
    other = Levels(True, 1 / 255, True, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    moved = msgspec.structs.replace(work[0], spec=pack_spec(msgspec.structs.replace(spec, levels=other)))
    (wrong,) = runner.run([moved], torch.from_numpy(items[0].pixel_values))
    assert (wrong - ours[0]).abs().max() > 1e-2


def test_validate_matches_dtype_levels_and_bytes(qwen2_vl_tiny: Path) -> None:
    workload = EncoderWorkload.from_facts(ModelFacts.from_checkpoint(qwen2_vl_tiny))
    item = load_processor(qwen2_vl_tiny).process_image(random_image(56, 56))
    work = work_item("k", item, 0, 0)
    assert workload.validate(work, item.pixel_values.nbytes) is None
    assert "pixel bytes" in workload.validate(work, item.pixel_values.nbytes * 4)
    as_float = msgspec.structs.replace(work, input_dtype="float32")
    assert "float32 pixels with levels" in workload.validate(as_float, item.pixel_values.nbytes * 4)
    spec = msgspec.msgpack.decode(work.spec, type=EncodeSpec)
    bare = msgspec.structs.replace(work, spec=pack_spec(msgspec.structs.replace(spec, levels=None)))
    assert "uint8 pixels without levels" in workload.validate(bare, item.pixel_values.nbytes)


def test_engine_refuses_an_unknown_input_dtype() -> None:
    engine = Engine(BatchLimits(max_patches=64), InstantExecutor(), EncoderWorkload(4, 3).validate)
    spec = pack_spec(EncodeSpec("image", (1, 2, 2), 3))
    item = WorkItem("a", "image", 4, 0, 128, spec, "float64")
    problem = engine._validate(WorkRequestMsg("r", [item]), [memoryview(np.zeros((4, 3), np.float64))])
    assert problem is not None and "input dtype 'float64'" in problem


def test_device_io_keeps_levels_and_refuses_mixed_batches() -> None:
    io = DeviceIO(torch.device("cpu"), None)
    levels = [torch.arange(6, dtype=torch.uint8), torch.full((3,), 255, dtype=torch.uint8)]
    out = io.inputs(levels, torch.bfloat16)
    assert out.dtype == torch.uint8 and out.tolist() == [0, 1, 2, 3, 4, 5, 255, 255, 255]
    assert io.inputs([torch.ones(2)], torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="mixes input dtypes"):
        io.inputs([levels[0], torch.ones(2)], torch.float32)
