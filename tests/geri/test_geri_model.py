"""Geri's model on an offline tiny Qwen-Image checkpoint: for the same prompt embeddings, seed and steps its float
images equal diffusers' own QwenImagePipeline's (float32, with and without classifier-free guidance): exactly for a
request alone (the same operations on the same shapes), within IMAGE_FLOAT_BOUND batched with other requests (another
batch shape orders the float sums differently); its 8-bit images round those floats as the pipeline does; bad
requests are refused naming the problem."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eric_epd.checkpoints.qwen_image import build_qwen_image_checkpoint
from eric_epd.geri.generator import ImageRequest, QwenImageGenerator
from eric_epd.testing.exactness import assert_floats_close


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen_image_checkpoint(tmp_path_factory.mktemp("qwen-image") / "tiny")


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(checkpoint, torch_dtype=torch.float32, text_encoder=None, tokenizer=None)


def _embeds(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, 128, generator=torch.Generator().manual_seed(seed))


def _diffusers(pipeline, r: ImageRequest) -> np.ndarray:
    """diffusers' pipeline on one request: the reference image, floats in [0, 1] before rounding to 8 bits."""
    kwargs = {}
    if r.negative_embeds is not None:
        kwargs = {
            "negative_prompt_embeds": r.negative_embeds[None],
            "negative_prompt_embeds_mask": torch.ones(1, r.negative_embeds.shape[0], dtype=torch.long),
        }
    out = pipeline(
        prompt_embeds=r.prompt_embeds[None],
        prompt_embeds_mask=torch.ones(1, r.prompt_embeds.shape[0], dtype=torch.long),
        height=r.height,
        width=r.width,
        num_inference_steps=r.steps,
        true_cfg_scale=r.true_cfg_scale,
        generator=torch.Generator().manual_seed(r.seed),
        output_type="np",
        **kwargs,
    )
    return out.images[0]


REQUESTS = [
    ImageRequest(_embeds(12, 1), height=64, width=64, steps=2, seed=11),
    ImageRequest(_embeds(7, 2), height=64, width=64, steps=2, seed=12),
    ImageRequest(
        _embeds(9, 3), height=32, width=96, steps=3, seed=13, negative_embeds=_embeds(5, 4), true_cfg_scale=4.0
    ),
]


def test_images_equal_diffusers_pipeline(checkpoint: Path, pipeline) -> None:
    geri = QwenImageGenerator(checkpoint)
    for r in REQUESTS:
        floats, image = geri.generate_floats([r])[0], geri.generate([r])[0]
        assert image.shape == (r.height, r.width, 3) and image.dtype == np.uint8
        # alone, in this process: the pipeline's own operations on the same shapes and threads, so exact floats
        np.testing.assert_array_equal(floats, _diffusers(pipeline, r))
        np.testing.assert_array_equal(image, (floats * 255).round().astype(np.uint8))  # the pipeline's rounding
        assert image.std() > 0  # not a blank image


def test_a_batch_gives_each_request_its_own_image(checkpoint: Path, pipeline) -> None:
    """Two prompts of different lengths (one padded under a mask) in one batch, each with its own seed."""
    geri = QwenImageGenerator(checkpoint)
    together = geri.generate_floats(REQUESTS[:2])
    for r, floats in zip(REQUESTS[:2], together):
        assert_floats_close(floats, _diffusers(pipeline, r))  # float sums of another batch shape
    assert not np.array_equal(together[0], together[1])


def test_bad_requests_are_refused_naming_the_problem(checkpoint: Path) -> None:
    geri = QwenImageGenerator(checkpoint)
    good = REQUESTS[0]
    cases = [
        (ImageRequest(_embeds(4, 0)[:, :100], 64, 64, 2, 0), "must be [tokens, 128]"),
        (ImageRequest(torch.zeros(0, 128), 64, 64, 2, 0), "has 0 tokens"),
        (ImageRequest(good.prompt_embeds, 62, 64, 2, 0), "height 62 must be a multiple of 4"),  # this tiny VAE's 2x
        (ImageRequest(good.prompt_embeds, 64, 4096, 2, 0), "width 4096 must be a multiple of 4 up to 1024"),
        (ImageRequest(good.prompt_embeds, 64, 64, 100_000, 0), "steps 100000"),
        (ImageRequest(torch.full((3, 128), float("nan")), 64, 64, 2, 0), "non-finite"),
    ]
    for request, named in cases:
        with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
            geri.check(request)
    geri.check(good)
    with pytest.raises(ValueError, match="share height"):
        geri.generate([REQUESTS[0], REQUESTS[2]])
