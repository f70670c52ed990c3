"""Qwen3.5 and Qwen3.5-MoE behind Eric: the tower (Qwen3-VL's without DeepStack) equals transformers', and in real
vLLM (bfloat16: vLLM's CPU kernels for its linear-attention layers need it) Qwen3.5's EPD tokens equal vLLM's own
encoder's, for images and a video (its frames and timestamps as Qwen3-VL's)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eric_epd.common.widths import embedding_width
from eric_epd.models.registry import load_encoder, load_processor, read_model_config
from eric_epd.stack.servers import EricServer
from eric_epd.testing.exactness import NEAR_TIE_BFLOAT16, assert_greedy_agree, assert_greedy_differ, other_isa_env
from eric_epd.testing.media import image_bytes, random_image
from eric_epd.testing.vllm_cases import (
    CASES,
    Case,
    encode_case,
    epd_prompt,
    eric_key_in_env,
    greedy_run,
    llm_kwargs,
    raw_prompt,
)


@pytest.mark.parametrize("family", ["qwen3_5_tiny", "qwen3_5_moe_tiny"])
def test_tower_equals_hf(family: str, request: pytest.FixtureRequest) -> None:
    """Qwen3.5 and Qwen3.5-MoE (the same tower) against transformers, images of odd sizes in one batch."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    qwen3_5_tiny: Path = request.getfixturevalue(family)
    cfg = read_model_config(qwen3_5_tiny)
    assert embedding_width(cfg) == cfg["vision_config"]["out_hidden_size"]  # no DeepStack levels
    images = [
        Image.open(io.BytesIO(image_bytes(random_image(w, h, seed=70 + i)))).convert("RGB")
        for i, (w, h) in enumerate([(120, 90), (33, 200), (224, 160)])
    ]
    hf_processor = AutoProcessor.from_pretrained(qwen3_5_tiny).image_processor
    model = AutoModelForImageTextToText.from_pretrained(qwen3_5_tiny, dtype=torch.float32).eval()
    processor, encoder = load_processor(qwen3_5_tiny), load_encoder(qwen3_5_tiny, torch.float32, "cpu")
    items = [processor.process_image(image) for image in images]
    out = encoder(
        torch.from_numpy(np.concatenate([i.float_pixels() for i in items])),
        torch.tensor([list(i.grid_thw) for i in items]),
    )
    for rows, item, image in zip(out.split([i.num_tokens for i in items]), items, images):
        inputs = hf_processor(images=[image], return_tensors="pt")
        np.testing.assert_array_equal(item.float_pixels(), inputs["pixel_values"].numpy())
        with torch.no_grad():
            ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
        torch.testing.assert_close(rows, ref, rtol=1e-4, atol=1e-5)


def test_vllm_epd_tokens_equal_monolithic(qwen3_5_tiny: Path, tmp_path: Path) -> None:
    """Qwen3.5 in vLLM behind a TP-2 Eric on another instruction set than vLLM and with other batches (each image
    encoded alone where vLLM's tower takes a case's images in one batch): one image, four images and a video.
    (Qwen3.5-MoE differs only in its language model: tests/gateway/test_gateway_qwen3.py runs it through vLLM.) In
    bfloat16 two correct towers (and one tower on two CPUs) differ by a few bfloat16 ulps, which flips a greedy
    token wherever the two best logprobs are that close: the tokens agree up to the first such near tie. Negative
    control: the four images' EPD answer fails the same comparison with vLLM's answer for four other images of the
    same sizes."""
    from vllm import LLM
    from vllm.config import ECTransferConfig

    with (
        EricServer(
            qwen3_5_tiny,
            tp=2,
            extra_args=("--dtype", "bfloat16", "--max-batch-items", "1"),
            log_path=tmp_path / "eric.log",
            env=other_isa_env(),
        ) as eric,
        eric_key_in_env(eric.api_key),
    ):
        ec = ECTransferConfig(
            ec_connector="EricECConnector",
            ec_role="ec_consumer",
            ec_buffer_device="cpu",
            ec_connector_extra_config={"eric_urls": [eric.url], "backends": ["shm"]},
        )
        llm = LLM(**{**llm_kwargs(qwen3_5_tiny), "dtype": "bfloat16"}, ec_transfer_config=ec)
        epd = {}
        for case in (c for c in CASES if c.name in ("one_image", "four_images", "one_video")):
            monolithic = greedy_run(llm, raw_prompt(case, model=qwen3_5_tiny))
            items = encode_case(eric.url, case, eric.api_key)
            epd[case.name] = greedy_run(llm, epd_prompt(case, items), items)
            assert_greedy_agree(epd[case.name], monolithic, NEAR_TIE_BFLOAT16, case.name)
        four = next(c for c in CASES if c.name == "four_images")
        wrong = greedy_run(llm, raw_prompt(Case("four_other_images", four.image_sizes, seed=43), model=qwen3_5_tiny))
        assert_greedy_differ(epd["four_images"], wrong, NEAR_TIE_BFLOAT16, "four_images against other images' answer")
        del llm
