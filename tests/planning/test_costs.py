"""The analytic stage costs: their linear terms equal twice the parameters transformers builds for a config, and the
shaped benchmark checkpoints have the released Qwen2.5-VL-3B's and -7B's cost ratios."""

from __future__ import annotations

import json

import pytest
import torch

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.planning.costs import (
    REFERENCES,
    decode_flops_per_token,
    encoder_flops_per_image_token,
    prefill_flops_per_token,
    stage_costs,
)


def _meta_model(config: dict):
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(text_config=config["text_config"], vision_config=config["vision_config"])
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(cfg)


def _linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_linear_terms_are_twice_transformers_parameters(name: str) -> None:
    """With the attention terms at zero length (context 0; the image's attention counted apart), the per-token costs
    are 2 FLOPs per weight of the linear layers transformers instantiates for the released config."""
    config = REFERENCES[name]
    model = _meta_model(config)
    visual, text = model.model.visual, model.model.language_model
    blocks = sum(_linear_params(b) for b in visual.blocks)
    merger = _linear_params(visual.merger)
    patch_embed = visual.patch_embed.proj.weight.numel()
    text_params = sum(_linear_params(layer) for layer in text.layers)
    v = config["vision_config"]
    patches, window = (448 // 14) ** 2, (112 // 14) ** 2
    full = len(v["fullatt_block_indexes"])
    attention = 4 * v["hidden_size"] * ((v["depth"] - full) * window + full * patches)
    expected_encoder = 4 * (2 * (blocks + patch_embed) + attention) + 2 * merger
    assert encoder_flops_per_image_token(config) == pytest.approx(expected_encoder, rel=1e-9)
    assert prefill_flops_per_token(config, context=0) == pytest.approx(2 * text_params, rel=1e-9)
    lm_head = model.lm_head.weight.numel()
    assert decode_flops_per_token(config, context=0) == pytest.approx(2 * (text_params + lm_head), rel=1e-9)


def test_released_ratios() -> None:
    """The references' ratios (documented in the README): 3B's prefill costs about what its tower does per image
    token, 7B's about 2.5 times."""
    three, seven = (stage_costs(REFERENCES[n]).ratios() for n in ("Qwen2.5-VL-3B-Instruct", "Qwen2.5-VL-7B-Instruct"))
    assert three["prefill_over_encoder"] == pytest.approx(1.087, abs=0.01)
    assert three["decode_over_encoder"] == pytest.approx(1.234, abs=0.01)
    assert seven["prefill_over_encoder"] == pytest.approx(2.519, abs=0.01)
    assert seven["decode_over_encoder"] == pytest.approx(2.766, abs=0.01)


@pytest.mark.parametrize(
    ("size", "reference"), [("shaped3b", "Qwen2.5-VL-3B-Instruct"), ("shaped7b", "Qwen2.5-VL-7B-Instruct")]
)
def test_shaped_checkpoints_match_the_released_ratios(size: str, reference: str) -> None:
    """The shaped checkpoints as built (their config.json) are within 20% of the released model on both ratios (the
    builder's sizes give within 6%)."""
    built = json.loads((ensure_checkpoint("qwen2_5_vl", size) / "config.json").read_text())
    ours, theirs = stage_costs(built).ratios(), stage_costs(REFERENCES[reference]).ratios()
    for key in ("prefill_over_encoder", "decode_over_encoder"):
        assert ours[key] == pytest.approx(theirs[key], rel=0.06), key
