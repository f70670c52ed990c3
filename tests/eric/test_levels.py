"""Qwen-VL pixels cross the processes as uint8 levels and are normalized on the worker's device: the tower's rows
equal its rows on transformers' own float32 pixel_values, other normalization settings give other rows, and the
engine and the device hand-off refuse what does not fit."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
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
    assert spec.repeat == 2 and spec.patch_dim == 2 * item.pixel_values.shape[1]  # one frame sent, repeated there
    whole = msgspec.structs.replace(work, spec=pack_spec(msgspec.structs.replace(spec, repeat=1)))
    assert "pixel bytes" in workload.validate(whole, item.pixel_values.nbytes)
    assert workload.validate(whole, 2 * item.pixel_values.nbytes) is None
    odd = msgspec.structs.replace(work, spec=pack_spec(msgspec.structs.replace(spec, repeat=5)))
    assert "repeated 5 times" in workload.validate(odd, item.pixel_values.nbytes)
    # a divisor of the row, but not the temporal patch: the worker would fail the batch (1176) or mislay the rows (4)
    for repeat in (4, 1176):
        wide = msgspec.structs.replace(work, spec=pack_spec(msgspec.structs.replace(spec, repeat=repeat)))
        nbytes = item.pixel_values.nbytes * 2 // repeat
        assert "temporal patch is 2" in workload.validate(wide, nbytes), repeat
    _, h, w = spec.grid_thw
    frames = msgspec.structs.replace(work, spec=pack_spec(msgspec.structs.replace(spec, grid_thw=(2, h // 2, w))))
    assert "an image's one frame" in workload.validate(frames, item.pixel_values.nbytes)  # two frames, one sent
    for mean, std in (((0.5, 0.5), spec.levels.std), ((0.5,) * 5, (0.5,) * 5)):  # unequal; not dividing the row
        levels = msgspec.structs.replace(spec.levels, mean=mean, std=std)
        skew = msgspec.structs.replace(work, spec=pack_spec(msgspec.structs.replace(spec, levels=levels)))
        assert "means and" in workload.validate(skew, item.pixel_values.nbytes)
    narrow = msgspec.structs.replace(work, spec=pack_spec(msgspec.structs.replace(spec, patch_dim=588, repeat=1)))
    assert "this encoder takes 1176" in workload.validate(narrow, item.pixel_values.nbytes)


def test_a_batch_of_repeated_and_whole_rows_equals_each_alone(qwen2_vl_tiny: Path) -> None:
    """An image's one-frame rows (repeated on the worker) and a one-frame video's whole rows in one batch: each
    item's rows are found at its own offset and equal its rows alone (to rounding); the two items' rows are equal."""
    processor, runner = load_processor(qwen2_vl_tiny), _runner(qwen2_vl_tiny)
    frame = np.asarray(random_image(84, 56, 4))
    image, video = processor.process_image(Image.fromarray(frame)), processor.process_video(frame[None])
    assert (image.repeat, video.repeat) == (2, 1)
    work = [work_item("i", image, 0, 0), work_item("v", video, 0, 0)]
    flat = torch.cat(
        [torch.from_numpy(image.pixel_values).reshape(-1), torch.from_numpy(video.pixel_values).reshape(-1)]
    )
    both = runner.run(work, flat)
    alone = [runner.run([w], torch.from_numpy(it.pixel_values))[0] for w, it in zip(work, (image, video))]
    for got, want in zip(both, alone):  # a batch's GEMMs block otherwise than one item's: rounding apart
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(both[0], both[1], rtol=0, atol=1e-4)
    # negative control: the same bytes in the other order are read at the wrong offsets and give other rows
    swapped = runner.run(
        work, torch.cat([torch.from_numpy(video.pixel_values).reshape(-1), flat[: image.pixel_values.size]])
    )
    assert (swapped[0] - alone[0]).abs().max() > 1e-2


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
