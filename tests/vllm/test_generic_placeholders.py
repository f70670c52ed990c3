"""vLLM's own multimodal processor (no engine started) on every tiny family of Eric's generic path: for each image,
the embedding positions of vLLM's placeholder are exactly as many as the rows Eric answers, the tensors vLLM would
feed its tower are Eric's, and the family's chat template puts the placeholder where vLLM looks for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eric_epd.checkpoints.families import FAMILIES, ensure_family_checkpoint
from eric_epd.models.hf.processor import HFImageProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.testing.media import random_image

pytestmark = pytest.mark.exactness

SIZES = ((150, 100), (90, 200), (33, 47))
"""Wide, tall and smaller than one tile."""


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholder_embeds_equal_eric_rows(family: str, _checkpoint_cache: Path) -> None:
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    ckpt = ensure_family_checkpoint(family)
    vllm_processor = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=str(ckpt), tokenizer=str(ckpt), dtype="float32", max_model_len=2048))
    prompt = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False, add_generation_prompt=True)
    eric = HFImageProcessor(ckpt)
    for seed, (width, height) in enumerate(SIZES):
        image = random_image(width, height, seed=seed)
        processed = vllm_processor(prompt, vllm_processor.info.parse_mm_data({"image": [image]}))
        (placeholder,) = processed["mm_placeholders"]["image"]
        item = eric.process_image(image)
        assert placeholder.get_num_embeds() == item.num_tokens, (width, height)
        ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        for name, field in processed["mm_kwargs"]["image"][0].items():
            theirs = field.data
            if name not in ours or not isinstance(theirs, torch.Tensor):
                continue  # vLLM's own bookkeeping (patch counts, token ids)
            mine = ours[name].reshape(theirs.shape)  # vLLM keeps one item without its batch dim
            if theirs.dtype == torch.uint8:  # normalised on the device by vLLM (Mistral 3, GLM-4.1V): the same math
                continue
            torch.testing.assert_close(mine.to(theirs.dtype), theirs, rtol=0, atol=0, msg=f"{name} {width}x{height}")
