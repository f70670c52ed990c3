"""The Qwen3-VL and Qwen3.5 families and Kimi-K2.5 behind SGLang's `--language-only --encoder-urls`, with SGLang's
real receiver classes (one prefill host for the module): Qwen image parts hold every DeepStack level in SGLang's
layout, video parts carry the timestamps SGLang writes into the prompt, and Kimi-K2.5's parts from Eric's generic
path are laid out by SGLang's own Kimi processor."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from eric_epd.checkpoints.families import ensure_family_checkpoint
from eric_epd.checkpoints.kimi import KIMI_IMAGE
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url, random_image
from tests.support.helpers_sglang import (  # noqa: F401  (bootstrap_port, setup: the prefill harness fixtures)
    ATOL,
    IMAGES,
    RTOL,
    bootstrap_port,
    check_equal,
    eric_tensors,
    prompt_for,
    setup,
)
from tests.support.kimi_reference import VllmKimi, transformers_rows


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_qwen3_family_parts_hold_every_deepstack_level(
    setup,  # noqa: F811
    family: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (SGLang's Qwen processor serves all four): SGLang's
    scheduler-side receiver (TP 1, float32) ends up holding, per image, transformers' rows in SGLang's own layout:
    [merged | DeepStack level 1 | level 2 ...] on the last dimension (merged alone where the tower has none)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    checkpoint: Path = request.getfixturevalue(f"{family}_tiny")
    prefill, _ = setup
    specs = IMAGES[:2]
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    inputs = processor.image_processor(images=[random_image(w, h, s) for w, h, s in specs], return_tensors="pt")
    with torch.no_grad():
        feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    levels = getattr(feats, "deepstack_features", None) or []
    rows = [
        torch.cat([merged, *(level[i] for level in levels)], dim=-1) for i, merged in enumerate(feats.pooler_output)
    ]
    urls = [image_data_url(*spec) for spec in specs]
    with EricServer(
        checkpoint,
        extra_args=("--transfer-backends", "shm", "--sglang-dtype", "float32"),
        log_path=tmp_path / "eric.log",
    ) as eric:
        result = prefill.job(
            kind="scheduler",
            model=str(checkpoint),
            backend="zmq_to_scheduler",
            encoder_urls=[eric.url],
            images=urls,
            prompt=prompt_for(len(urls)),
            tp=1,
            dtype="float32",
        )
        assert result.dispatch_error is None
        check_equal(
            result.outcomes[0], eric_tensors(eric, urls), (rows, inputs["image_grid_thw"].tolist()), torch.float32
        )
    assert rows[0].shape[1] == (1 + len(levels)) * model.config.vision_config.out_hidden_size


@pytest.fixture(scope="module")
def kimi(_checkpoint_cache: Path) -> Path:
    return ensure_family_checkpoint("kimi_k25")


def _transformers_rows(kimi: Path, specs: list) -> tuple[list[torch.Tensor], list]:
    """transformers' model on vLLM's own processor's tensors for each image (tests/support/kimi_reference.py)."""
    vllm = VllmKimi(kimi)
    inputs = [vllm.inputs(random_image(w, h, s)) for w, h, s in specs]
    return transformers_rows(kimi, inputs), [i.grid_thw[0].tolist() for i in inputs]


def test_kimi_parts_are_laid_out_by_sglangs_kimi_processor(setup, kimi: Path, tmp_path: Path) -> None:  # noqa: F811
    """Three images of different sizes: SGLang's scheduler-side receiver (TP 1, float32) holds, per image, Eric's
    rows and transformers' (in order), with the patch grid SGLang's Kimi processor expands each placeholder by."""
    prefill, _ = setup
    specs = IMAGES
    urls = [image_data_url(*spec) for spec in specs]
    hf = _transformers_rows(kimi, specs)
    prompt = "Describe " + " and ".join([KIMI_IMAGE] * len(urls)) + " please."
    with EricServer(
        kimi, extra_args=("--transfer-backends", "shm", "--sglang-dtype", "float32"), log_path=tmp_path / "eric.log"
    ) as eric:
        result = prefill.job(
            kind="scheduler",
            model=str(kimi),
            backend="zmq_to_scheduler",
            encoder_urls=[eric.url],
            images=urls,
            prompt=prompt,
            tp=1,
            dtype="float32",
        )
        assert result.dispatch_error is None
        check_equal(result.outcomes[0], eric_tensors(eric, urls), hf, torch.float32)
    # the prompt SGLang builds holds one run of media tokens per image, as long as its rows
    media = json.loads((kimi / "config.json").read_text())["media_placeholder_token_id"]
    runs = [len(list(group)) for token, group in itertools.groupby(result.outcomes[0].input_ids) if token == media]
    assert runs == [rows.shape[0] for rows in hf[0]]
