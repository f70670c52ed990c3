"""Kimi-K2.5 on the generic path: vLLM preprocesses its images with its own processor (PIL's bicubic, zero padding,
the tower's device normalization), not transformers'. Against vLLM's own multimodal processor and transformers' model
called directly (tests/support/kimi_reference.py, no Eric code), for odd and even sizes, kept and scaled: Eric's
tensors are vLLM's bit for bit, its row counts vLLM's placeholders, its rows transformers' model's on vLLM's tensors;
a wrong resize fails the comparison; a checkpoint whose two sets of settings disagree is refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from eric_epd.checkpoints.families import ensure_family_checkpoint
from eric_epd.models.hf import kimi as eric_kimi
from eric_epd.models.hf.processor import HFImageProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.testing.media import random_image
from tests.support.generic_batches import generic_runner, relative_error, run_batch
from tests.support.kimi_reference import KimiInputs, VllmKimi, transformers_inputs, transformers_rows, vllm_table_values

pytestmark = pytest.mark.exactness

KEPT = ((96, 64), (48, 80), (97, 61), (61, 97), (99, 77), (112, 112), (111, 111), (29, 29), (27, 13), (1, 1))
"""(width, height) within 8 patches (112 pixels) a side: kept as they are, odd ones padded."""
SCALED = (
    (113, 113),
    (125, 125),
    (333, 127),
    (127, 333),
    (123, 45),
    (1, 300),
    (300, 1),
    (511, 512),
    (512, 511),
    (129, 57),
    (17, 300),
    (1000, 700),
    (3000, 7),
    (7, 3000),
)
"""Scaled down (the tiny checkpoint's side limit binds before its 64-patch limit): odd, one pixel over, one pixel
wide or high, one pixel off square, extremes."""
ULP = 1.2e-7
"""vLLM's two normalizations of the same byte (the tower's byte * w + b, the processor's (v / 255 - mean) / std in a
table) are an ulp apart at most: 2^-23 near 1."""
RTOL = 1e-5
"""Eric's runner against transformers' full model on the same tensors (float32; a batch changes matmul rounding)."""


@pytest.fixture(scope="module")
def kimi(_checkpoint_cache: Path) -> Path:
    return ensure_family_checkpoint("kimi_k25")


@pytest.fixture(scope="module")
def vllm(kimi: Path) -> VllmKimi:
    return VllmKimi(kimi)


def _image(size: tuple[int, int]) -> Image.Image:
    width, height = size
    return random_image(width, height, seed=width * 7 + height)


def _eric(processor: HFImageProcessor, image: Image.Image) -> KimiInputs:
    item = processor.process_image(image)
    tensors = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
    return KimiInputs(tensors["pixel_values"], tensors["image_grid_thw"], item.num_tokens)


def _assert_same(ours: KimiInputs, theirs: KimiInputs, size: tuple[int, int]) -> None:
    assert ours.grid_thw.tolist() == theirs.grid_thw.tolist(), size
    assert ours.tokens == theirs.tokens, size
    assert ours.pixel_values.dtype == theirs.pixel_values.dtype == torch.float32, size
    assert torch.equal(ours.pixel_values, theirs.pixel_values), (
        size,
        (ours.pixel_values - theirs.pixel_values).abs().max().item(),
    )


@pytest.mark.parametrize("sizes", [KEPT, SCALED], ids=["kept", "scaled"])
def test_eric_tensors_are_vllms(kimi: Path, vllm: VllmKimi, sizes: tuple[tuple[int, int], ...]) -> None:
    """Per image: Eric's pixel_values equal, bit for bit, what vLLM's tower gets by default (its processor's bytes
    through its device normalization), its grid vLLM's grid_thws and its rows vLLM's media tokens; and they are within
    an ulp of vLLM's processor normalizing on the CPU (mm_device_do_normalize off)."""
    eric = HFImageProcessor(kimi)
    for size in sizes:
        image = _image(size)
        ours = _eric(eric, image)
        _assert_same(ours, vllm.inputs(image), size)
        torch.testing.assert_close(ours.pixel_values, vllm_table_values(kimi, image), rtol=0, atol=ULP, msg=str(size))


@pytest.mark.parametrize("wrong", ["bilinear", "one_column_narrower"])
def test_a_wrong_resize_fails_the_comparison(
    kimi: Path, vllm: VllmKimi, wrong: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative controls: Eric scaling with another filter, or to one column fewer (the grid unchanged), gives
    tensors the comparison refuses on every scaled image (kept ones never go through a resize of another size)."""
    if wrong == "bilinear":
        monkeypatch.setattr(eric_kimi, "RESAMPLE", Image.Resampling.BILINEAR)
    else:
        right = eric_kimi.kimi_size

        def narrower(height: int, width: int, image_processor: object) -> tuple[int, int]:
            scaled_height, scaled_width = right(height, width, image_processor)
            return scaled_height, max(1, scaled_width - 1)

        monkeypatch.setattr(eric_kimi, "kimi_size", narrower)
    eric = HFImageProcessor(kimi)
    for size in ((113, 113), (333, 127), (511, 512), (1000, 700), (129, 57)):
        image = _image(size)
        with pytest.raises(AssertionError):
            _assert_same(_eric(eric, image), vllm.inputs(image), size)


def test_transformers_processor_is_not_vllms(kimi: Path, vllm: VllmKimi) -> None:
    """Why Eric does not run transformers' processor for this family: same grids and token counts, but on images it
    scales, torchvision's bicubic lands whole 8-bit levels away from PIL's (2/255 after normalization); on kept ones
    the two normalizations are an ulp apart."""
    for size in KEPT:
        image = _image(size)
        ref, hf = vllm.inputs(image), transformers_inputs(kimi, image)
        assert hf.grid_thw.tolist() == ref.grid_thw.tolist() and hf.tokens == ref.tokens, size
        torch.testing.assert_close(hf.pixel_values, ref.pixel_values, rtol=0, atol=ULP, msg=str(size))
    apart = 0.0
    for size in SCALED:
        image = _image(size)
        ref, hf = vllm.inputs(image), transformers_inputs(kimi, image)
        assert hf.grid_thw.tolist() == ref.grid_thw.tolist() and hf.tokens == ref.tokens, size
        apart = max(apart, float((hf.pixel_values - ref.pixel_values).abs().max()))
    assert apart >= 2 / 255


def test_rows_equal_transformers_model_on_vllms_tensors(kimi: Path, vllm: VllmKimi) -> None:
    """Odd and even sizes, kept and scaled: Eric's rows, each image alone and all in one batch, equal transformers'
    full model's get_image_features on vLLM's tensors for the image."""
    sizes = ((97, 61), (1, 300), (333, 127), (511, 512), (96, 64), (27, 13), (113, 113))
    images = [_image(size) for size in sizes]
    refs = transformers_rows(kimi, [vllm.inputs(image) for image in images])
    eric = HFImageProcessor(kimi)
    items = [eric.process_image(image) for image in images]
    workload, runner = generic_runner(kimi)
    for size, item, ref in zip(sizes, items, refs):
        (alone,) = run_batch(workload, runner, [item])
        assert alone.shape == ref.shape and relative_error(alone, ref) <= RTOL, size
    for size, ours, ref in zip(sizes, run_batch(workload, runner, items), refs):
        assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, size


@pytest.mark.parametrize(
    ("key", "value", "shown"), [("in_patch_limit", 4096, r"\(64, 4096\)"), ("fixed_output_tokens", 16, r"\(None, 16\)")]
)
def test_settings_that_disagree_with_vllms_are_refused(
    kimi: Path, tmp_path: Path, key: str, value: int, shown: str
) -> None:
    """media_proc_cfg (vLLM's) with another patch limit than transformers' settings, or a fixed token count per
    image: Eric refuses the checkpoint, naming both values."""
    copy = Path(shutil.copytree(kimi, tmp_path / "kimi"))
    path = copy / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"]["media_proc_cfg"][key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"media_proc_cfg.*{key}.*{shown}"):
        HFImageProcessor(copy)
