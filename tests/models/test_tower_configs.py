"""Eric's hand-written Qwen vision towers follow their checkpoint's config, never the released models': on tiny
checkpoints whose vision config differs from the released one in one thing at a time (the learned position grid,
square or not; patch, temporal patch and merge sizes; depth; window size and full-attention blocks; DeepStack taps),
built and saved by transformers, the tower the registry loads gives transformers' own `get_image_features` rows on
the same patches (one batch: two images of one grid, the negative control, and a two-frame item), and ModelFacts
agrees with it on the patch row, the merge size and the row width. A config that leaves keys out gets transformers'
defaults of its family (common/tower_defaults.py, checked against transformers' classes here).

The Omni thinkers' towers: test_tower_configs_omni.py; Qwen2-Audio's, Gemma 3's and InternVL's:
test_tower_configs_more.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from eric_epd.common.tower_defaults import VISION_DEFAULTS
from eric_epd.common.widths import embedding_width
from eric_epd.models.facts import ModelFacts
from eric_epd.models.registry import build_encoder, load_encoder
from tests.support.tower_cases import (
    INIT_STD,
    QWEN2_5_VL,
    QWEN2_VL,
    QWEN3_5,
    QWEN3_5_TEXT,
    QWEN3_TEXT,
    QWEN3_VL,
    TEXT,
    assert_rows_equal,
    random_rows,
    saved_model,
    varied,
)

GRIDS = ((1, 5, 3), (1, 5, 3), (2, 2, 4))
"""Items' (t, h, w) in merge windows: two images of one grid (the negative control's pair), then two frames."""


def _config(model_type: str, vision: dict[str, Any]) -> Any:
    """The transformers config of a tiny `model_type` checkpoint with this vision config."""
    import transformers

    classes = {
        "qwen2_vl": ("Qwen2VLConfig", TEXT),
        "qwen2_5_vl": ("Qwen2_5_VLConfig", TEXT),
        "qwen3_vl": ("Qwen3VLConfig", QWEN3_TEXT),
        "qwen3_vl_moe": (
            "Qwen3VLMoeConfig",
            {**QWEN3_TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        ),
        "qwen3_5": ("Qwen3_5Config", QWEN3_5_TEXT),
    }
    name, text = classes[model_type]
    return getattr(transformers, name)(vision_config=vision, text_config=text, initializer_range=INIT_STD)


def _hf_rows(model: Any, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
    """transformers' rows per item: `get_image_features`' merged rows, DeepStack levels beside them (Qwen3-VL)."""
    with torch.no_grad():
        out = model.model.get_image_features(pixels, grid)
    levels = getattr(out, "deepstack_features", None) or []
    return [torch.cat([rows, *(level[i] for level in levels)], dim=-1) for i, rows in enumerate(out.pooler_output)]


def _check_tower(model_type: str, vision: dict[str, Any], tmp_path: Path) -> None:
    """The case: transformers' model of `vision` saved, Eric's tower loaded through the registry, rows compared."""
    from transformers import AutoModelForImageTextToText

    model = saved_model(AutoModelForImageTextToText, _config(model_type, vision), tmp_path)
    facts = ModelFacts.from_checkpoint(tmp_path)
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    row = 3 * vision["temporal_patch_size"] * patch * patch
    assert (facts.pixel_row, facts.merge_size) == (row, merge)
    grid = torch.tensor([(t, h * merge, w * merge) for t, h, w in GRIDS])
    items = random_rows([(int(g.prod()), row) for g in grid], seed=3)
    refs = _hf_rows(model, torch.cat(items), grid)
    assert refs[0].shape[1] == facts.embedding_width == embedding_width(facts.config)
    encoder = load_encoder(tmp_path, torch.float32, "cpu")
    assert [encoder.depth, encoder.patch_size, encoder.merge] == [vision["depth"], patch, merge]
    ours = encoder(torch.cat(items), grid).split(encoder.num_tokens(grid))
    assert_rows_equal(ours, refs)


@pytest.mark.parametrize(
    "vision",
    varied(
        QWEN2_VL,
        {
            "patch_8": {"patch_size": 8},
            "merge_3": {"spatial_merge_size": 3},
            "depth_3": {"depth": 3},
            "temporal_1": {"temporal_patch_size": 1},
            "width_48_heads_3": {"embed_dim": 48, "num_heads": 3},
        },
    ),
)
def test_qwen2_vl_follows_its_config(vision: dict[str, Any], tmp_path: Path) -> None:
    _check_tower("qwen2_vl", vision, tmp_path)


@pytest.mark.parametrize(
    "vision",
    varied(
        QWEN2_5_VL,
        {
            "patch_8": {"patch_size": 8, "window_size": 32},
            "merge_3": {"spatial_merge_size": 3, "window_size": 84},
            "window_112": {"window_size": 112},
            "window_28": {"window_size": 28},
            "no_full_attention": {"fullatt_block_indexes": []},
            "depth_3_full_0_2": {"depth": 3, "fullatt_block_indexes": [0, 2]},
            "depth_4_full_3": {"depth": 4, "fullatt_block_indexes": [3]},
        },
    ),
)
def test_qwen2_5_vl_follows_its_config(vision: dict[str, Any], tmp_path: Path) -> None:
    _check_tower("qwen2_5_vl", vision, tmp_path)


@pytest.mark.parametrize(
    "vision",
    varied(
        QWEN3_VL,
        {
            "grid_6x6": {"num_position_embeddings": 36},
            "grid_4x4": {"num_position_embeddings": 16},
            "grid_40_not_square": {"num_position_embeddings": 40},
            "patch_8": {"patch_size": 8},
            "merge_3": {"spatial_merge_size": 3},
            "depth_2_tap_1": {"depth": 2, "deepstack_visual_indexes": [1]},
            "tap_2": {"deepstack_visual_indexes": [2]},
            "no_deepstack": {"deepstack_visual_indexes": []},
            "depth_4_taps_0_2_3": {"depth": 4, "deepstack_visual_indexes": [0, 2, 3]},
        },
    ),
)
def test_qwen3_vl_follows_its_config(vision: dict[str, Any], tmp_path: Path) -> None:
    _check_tower("qwen3_vl", vision, tmp_path)


def test_qwen3_vl_moe_follows_its_config(tmp_path: Path) -> None:
    _check_tower("qwen3_vl_moe", {**QWEN3_VL, "num_position_embeddings": 36, "patch_size": 8}, tmp_path)


@pytest.mark.parametrize(
    "vision",
    varied(
        QWEN3_5,
        {
            "grid_6x6_patch_8": {"num_position_embeddings": 36, "patch_size": 8},
            "merge_3_depth_2": {"spatial_merge_size": 3, "depth": 2},
        },
    ),
)
def test_qwen3_5_follows_its_config(vision: dict[str, Any], tmp_path: Path) -> None:
    _check_tower("qwen3_5", vision, tmp_path)


def test_deepstack_taps_outside_the_tower_are_refused() -> None:
    from eric_epd.models.qwen3_vl import Qwen3VLVisionEncoder

    for taps in ([3], [1, 1]):
        with pytest.raises(ValueError, match="deepstack_visual_indexes"), torch.device("meta"):
            Qwen3VLVisionEncoder({**QWEN3_VL, "deepstack_visual_indexes": taps})


# ---- defaults ------------------------------------------------------------------------------------------------
VISION_CONFIG_CLASSES = {
    "qwen2_vl": "qwen2_vl.configuration_qwen2_vl.Qwen2VLVisionConfig",
    "qwen2_5_vl": "qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig",
    "qwen3_vl": "qwen3_vl.configuration_qwen3_vl.Qwen3VLVisionConfig",
    "qwen3_vl_moe": "qwen3_vl_moe.configuration_qwen3_vl_moe.Qwen3VLMoeVisionConfig",
    "qwen3_5": "qwen3_5.configuration_qwen3_5.Qwen3_5VisionConfig",
    "qwen3_5_moe": "qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeVisionConfig",
    "qwen2_5_omni": "qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniVisionEncoderConfig",
    "qwen3_omni_moe": "qwen3_omni_moe.configuration_qwen3_omni_moe.Qwen3OmniMoeVisionEncoderConfig",
}


def _class_defaults(path: str) -> dict[str, Any]:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)().to_dict()


@pytest.mark.parametrize("model_type", sorted(VISION_CONFIG_CLASSES))
def test_defaults_are_transformers_own(model_type: str) -> None:
    """A table holds transformers' default of every key of its family's vision config that the tower reads (the rest:
    the base config's, initialisation, the rotary base that qwen2_vl.rope_theta reads with the same default, and
    Qwen2.5-VL's video timing, which only the language model's positions use)."""
    from transformers import PreTrainedConfig

    theirs = _class_defaults(VISION_CONFIG_CLASSES[model_type])
    unread = set(PreTrainedConfig().to_dict()) | {"initializer_range", "rope_parameters", "tokens_per_second"}
    ours = {k: list(v) if isinstance(v, tuple) else v for k, v in VISION_DEFAULTS[model_type].items()}
    assert ours == {k: v for k, v in theirs.items() if k not in unread}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_keys_left_out_take_transformers_defaults(model_type: str, tmp_path: Path) -> None:
    """A config.json whose vision_config names only the widths: Eric builds the tower transformers builds (its
    family's patch, merge, depth, position grid, windows and DeepStack taps) and ModelFacts agrees."""
    from transformers import AutoConfig

    widths = {"qwen2_vl": {"embed_dim": 32, "hidden_size": 32, "num_heads": 2}}.get(
        model_type, {"hidden_size": 32, "out_hidden_size": 32, "num_heads": 2, "intermediate_size": 32}
    )
    config = _config(model_type, widths).to_dict()
    config["vision_config"] = {"model_type": config["vision_config"]["model_type"], **widths}
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = AutoConfig.from_pretrained(tmp_path).vision_config
    ours = build_encoder(tmp_path, torch.float32, "meta")
    assert [ours.depth, ours.patch_size, ours.merge, ours.temporal_patch_size] == [
        theirs.depth,
        theirs.patch_size,
        theirs.spatial_merge_size,
        theirs.temporal_patch_size,
    ]
    assert sorted(ours.tap_layers) == sorted(getattr(theirs, "deepstack_visual_indexes", None) or [])
    if hasattr(theirs, "num_position_embeddings"):
        assert ours.side == int(theirs.num_position_embeddings**0.5)
    if hasattr(theirs, "window_size"):
        assert (ours.window_size, ours.fullatt_block_indexes) == (theirs.window_size, set(theirs.fullatt_block_indexes))
    facts = ModelFacts.from_checkpoint(tmp_path)
    assert facts.pixel_row == theirs.in_channels * theirs.temporal_patch_size * theirs.patch_size**2
    assert facts.embedding_width == 32 * (1 + len(ours.tap_layers))
