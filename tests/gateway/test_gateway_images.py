"""OpenAI's /v1/images/generations through the gateway: the prompt's hidden states from real `vllm serve` running the
tiny Qwen2.5-VL as a pooling text encoder, then Geri; the image equals diffusers' QwenImagePipeline run end to end
with the same text encoder (transformers) and prompt, up to the rounding of float images within a stated bound. Bad
requests get a 400 naming the problem."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from eric_epd.checkpoints.qwen_image import ensure_qwen_image_checkpoint
from eric_epd.stack.process import new_key, running
from eric_epd.stack.servers import GatewayServer, GeriServer, VllmServe
from eric_epd.testing.exactness import assert_rounds_from, other_isa_env

PROMPT_TOKENS = 256
"""The text encoder's max_model_len: a long prompt within MAX_PROMPT_CHARS passes it (its 400 is the client's)."""


@pytest.fixture(scope="module")
def image_stack(qwen2_5_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """vLLM (its key checked) serving the tiny Qwen2.5-VL as a token_embed pooling model, Geri, and an images-only
    gateway in front."""
    logs = tmp_path_factory.mktemp("images")
    vllm_key = new_key()
    pooling = ("--runner", "pooling", "--pooler-config", json.dumps({"task": "token_embed"}))
    encoder = VllmServe(
        qwen2_5_vl_tiny, logs / "vllm.log", extra=pooling, api_key=vllm_key, max_model_len=PROMPT_TOKENS
    )
    geri = GeriServer(log_path=logs / "geri.log", env=other_isa_env())
    gateway = GatewayServer(
        logs / "gateway.log",
        "--text-encoder-urls",
        encoder.url,
        "--geri-urls",
        geri.url,
        "--image-urls",
        upstream_api_key=vllm_key,
        api_key="sk-images",
        geri_api_key=geri.api_key,
    )
    with running(encoder, geri), gateway as gw:
        yield gw


@pytest.fixture(scope="module")
def reference_pipeline(qwen2_5_vl_tiny: Path):
    """diffusers' QwenImagePipeline end to end: the tiny Qwen2.5-VL (transformers) as its text encoder."""
    from diffusers import QwenImagePipeline
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_tiny, dtype=torch.float32)
    return QwenImagePipeline.from_pretrained(
        ensure_qwen_image_checkpoint("tiny"),
        torch_dtype=torch.float32,
        text_encoder=text_encoder,
        tokenizer=AutoTokenizer.from_pretrained(qwen2_5_vl_tiny),
    )


# Geri's float bound, and vLLM's float32 hidden states differing from transformers' in the last bits: measured up to
# ~2e-6 apart in the image here, across instruction sets
GATEWAY_IMAGE_BOUND = 3e-5


def _decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.mark.parametrize("negative", [None, "blurry, low quality"])
def test_image_equals_diffusers_pipeline_end_to_end(
    image_stack: GatewayServer, reference_pipeline, negative: str | None
) -> None:
    client = openai.OpenAI(base_url=image_stack.url + "/v1", api_key="sk-images", max_retries=0)
    prompt = "a red cube on a wooden table next to a small green plant"
    extra = {
        "num_inference_steps": 3,
        "seed": 7,
        "true_cfg_scale": 4.0,
        **({"negative_prompt": negative} if negative else {}),
    }
    answer = client.images.generate(prompt=prompt, size="64x48", response_format="b64_json", n=2, extra_body=extra)
    assert len(answer.data) == 2
    images = [_decode(d.b64_json) for d in answer.data]
    for i, image in enumerate(images):
        reference = reference_pipeline(
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=4.0,
            height=48,
            width=64,
            num_inference_steps=3,
            generator=torch.Generator().manual_seed(7 + i),
            output_type="np",
        ).images[0]
        assert image.shape == reference.shape == (48, 64, 3)
        # vLLM's and transformers' hidden states differ in the last float bits: the 8-bit image is exact only where
        # the reference's float pixel is not that close to a rounding boundary
        assert_rounds_from(image, reference, bound=GATEWAY_IMAGE_BOUND)
    assert not np.array_equal(images[0], images[1])  # each of n gets its own seed


def test_url_answers_link_the_same_image(image_stack: GatewayServer) -> None:
    """response_format "url": a link under the gateway (no key needed: the unguessable name is the capability) to
    the PNG b64_json gives for the same request."""
    client = openai.OpenAI(base_url=image_stack.url + "/v1", api_key="sk-images", max_retries=0)
    settings = {"prompt": "a blue sphere", "size": "32x32", "extra_body": {"num_inference_steps": 2, "seed": 3}}
    linked = client.images.generate(response_format="url", **settings).data[0].url
    inline = client.images.generate(response_format="b64_json", **settings).data[0].b64_json
    assert linked.startswith(image_stack.url + "/v1/images/files/")
    fetched = httpx.get(linked)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    np.testing.assert_array_equal(_decode(base64.b64encode(fetched.content).decode()), _decode(inline))
    assert httpx.get(image_stack.url + "/v1/images/files/" + "A" * 22 + ".png").status_code == 404
    assert httpx.get(image_stack.url + "/v1/images/files/..%2Fetc%2Fpasswd").status_code == 404


def test_bad_image_requests_get_a_400_naming_the_problem(image_stack: GatewayServer) -> None:
    headers = {"Authorization": "Bearer sk-images"}
    cases = [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 5000}, "prompt"),
        ({"prompt": "cat", "n": 10}, "n"),
        ({"prompt": "cat", "size": "big"}, "size must be WIDTHxHEIGHT"),
        ({"prompt": "cat", "size": "62x64", "num_inference_steps": 1}, "width 62 must be a multiple of 4"),
        ({"prompt": "cat", "size": "8192x8192", "num_inference_steps": 1}, "up to 1024"),
        ({"prompt": "cat", "num_inference_steps": 0}, "num_inference_steps"),
    ]
    for body, named in cases:
        r = httpx.post(image_stack.url + "/v1/images/generations", json=body, headers=headers, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert named in r.json()["error"]["message"], (named, r.text)
    too_long = " ".join(f"w{i}" for i in range(600))  # within MAX_PROMPT_CHARS, over the encoder's PROMPT_TOKENS
    r = httpx.post(image_stack.url + "/v1/images/generations", json={"prompt": too_long}, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    assert "text encoder refused the prompt" in r.json()["error"]["message"] and "127.0.0.1" not in r.text
    assert httpx.post(image_stack.url + "/v1/images/generations", json={"prompt": "cat"}).status_code == 401
    chat = httpx.post(
        image_stack.url + "/v1/chat/completions",
        headers=headers,
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 404 and "image generation only" in chat.json()["error"]["message"]
