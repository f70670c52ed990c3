"""Kimi-K2.5 behind SGLang's `--language-only --encoder-urls`, with SGLang's real receiver classes and its own Kimi
multimodal processor: the parts Eric's generic path sends (rows and the patch grid) are laid out by SGLang's Kimi
placement, one expanded `<|media_pad|>` run per image, and hold transformers' rows."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from eric_epd.checkpoints.families import ensure_family_checkpoint
from eric_epd.checkpoints.kimi import KIMI_IMAGE
from eric_epd.models.hf.adapters import kimi_resized
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url, random_image
from tests.support.helpers_sglang import (  # noqa: F401  (bootstrap_port, setup: the prefill harness fixtures)
    IMAGES,
    bootstrap_port,
    check_equal,
    eric_tensors,
    setup,
)


@pytest.fixture(scope="module")
def kimi(_checkpoint_cache: Path) -> Path:
    return ensure_family_checkpoint("kimi_k25")


def _transformers_rows(kimi: Path, specs: list) -> tuple[list[torch.Tensor], list]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(kimi)
    model = AutoModelForImageTextToText.from_pretrained(kimi, dtype=torch.float32).eval()
    images = [kimi_resized(random_image(w, h, s), processor.image_processor) for w, h, s in specs]
    inputs = processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        rows = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return list(rows), inputs["image_grid_thw"].tolist()


def test_kimi_parts_are_laid_out_by_sglangs_kimi_processor(setup, kimi: Path, tmp_path: Path) -> None:  # noqa: F811
    """Three images of different sizes: SGLang's scheduler-side receiver (TP 1, float32) holds, per image, Eric's
    rows and transformers' (in order), with the patch grid SGLang's Kimi processor expands each placeholder by."""
    prefill, _ = setup
    specs = IMAGES
    urls = [image_data_url(*spec) for spec in specs]
    hf = _transformers_rows(kimi, specs)
    prompt = "Describe " + " and ".join([KIMI_IMAGE] * len(urls)) + " please."
    with EricServer(kimi, extra_args=("--transfer-backends", "shm", "--sglang-dtype", "float32"),
                    log_path=tmp_path / "eric.log") as eric:
        result = prefill.job(kind="scheduler", model=str(kimi), backend="zmq_to_scheduler",
                             encoder_urls=[eric.url], images=urls, prompt=prompt, tp=1, dtype="float32")
        assert result.dispatch_error is None
        check_equal(result.outcomes[0], eric_tensors(eric, urls), hf, torch.float32)
    # the prompt SGLang builds holds one run of media tokens per image, as long as its rows
    media = json.loads((kimi / "config.json").read_text())["media_placeholder_token_id"]
    runs = [len(list(group)) for token, group in itertools.groupby(result.outcomes[0].input_ids) if token == media]
    assert runs == [rows.shape[0] for rows in hf[0]]
