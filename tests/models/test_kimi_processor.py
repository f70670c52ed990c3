"""Kimi-K2.5 on the generic path: vLLM preprocesses its images with its own processor (PIL scaling, `media_proc_cfg`),
not transformers'; Eric's tensors and row counts must be vLLM's for images kept and scaled down alike, and a
checkpoint whose two sets of settings disagree is refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eric_epd.checkpoints.families import ensure_family_checkpoint
from eric_epd.models.hf.processor import HFImageProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.testing.media import random_image

SIZES = ((96, 64), (48, 80), (130, 100), (200, 150), (333, 91), (17, 300), (1000, 700))
"""Kept (the first two), scaled by the side limit, by the patch limit, very wide, very tall, large."""
NORMALIZE_ATOL = 1e-7
"""vLLM normalizes through a float32 table ((v/255 - mean) / std), transformers in float32 arithmetic: the same
8-bit values give float32 values up to an ulp apart (measured 5.9e-8)."""


@pytest.fixture(scope="module")
def kimi(_checkpoint_cache: Path) -> Path:
    return ensure_family_checkpoint("kimi_k25")


def test_eric_tensors_are_vllms(kimi: Path) -> None:
    """Per image: Eric's pixel_values and grid equal vLLM's own Kimi processor's, and its rows equal the number of
    media tokens vLLM's placeholder holds."""
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    eric = HFImageProcessor(kimi)
    vllm = KimiK25FusedVisionProcessor.from_pretrained(str(kimi))
    for w, h in SIZES:
        image = random_image(w, h, seed=w + h)
        item = eric.process_image(image)
        ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        theirs = vllm.preprocess([{"type": "image", "image": image}], return_tensors="pt")
        assert ours["image_grid_thw"].tolist() == theirs["grid_thws"].tolist(), (w, h)
        torch.testing.assert_close(ours["pixel_values"], theirs["pixel_values"], rtol=0, atol=NORMALIZE_ATOL,
                                   msg=str((w, h)))
        assert item.num_tokens == vllm.media_tokens_calculator({"type": "image", "image": image}), (w, h)


def test_settings_that_disagree_with_vllms_are_refused(kimi: Path, tmp_path: Path) -> None:
    """media_proc_cfg (vLLM's) with another patch limit than transformers' settings: Eric refuses the checkpoint,
    naming both values."""
    copy = Path(shutil.copytree(kimi, tmp_path / "kimi"))
    path = copy / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"]["media_proc_cfg"]["in_patch_limit"] = 4096
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"media_proc_cfg.*in_patch_limit.*\(64, 4096\)"):
        HFImageProcessor(copy)
