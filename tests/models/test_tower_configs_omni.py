"""The Omni thinkers' towers of Eric's own (models/qwen2_5_omni.py, models/qwen3_omni.py) follow their checkpoint's
config: on tiny thinker checkpoints whose vision or audio config differs from the released one in one thing at a time,
built and saved by transformers, they give transformers' thinker's `get_image_features` and `get_audio_features` rows
on the same inputs (two items of one shape, the negative control, and a third). Vision: a smaller learned position
grid, square or not (the issue: Eric refused a grid transformers reads, and never started), patch and merge sizes,
depth, windows and full-attention blocks, DeepStack taps. Audio: chunk and attention windows, the convolutions'
batch, mel bins, widths, depth and the positional table's length. On the generic path, the warm-up item of a Qwen3-Omni
checkpoint with a non-square grid runs and equals transformers'.

Qwen3-Omni's `n_window` is not varied: transformers itself counts 13 rows per full chunk (the released 100 frames),
so its own tower gives rows its processor does not expect for any other value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eric_epd.models.qwen2_5_omni import Qwen2_5OmniTowers
from eric_epd.models.qwen3_omni import Qwen3OmniTowers
from tests.support.tower_cases import (
    INIT_STD,
    QWEN2_5_VL,
    QWEN3_TEXT,
    QWEN3_VL,
    TEXT,
    assert_rows_equal,
    random_rows,
    saved_model,
    varied,
)

QWEN2_5_AUDIO = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
    "n_window": 100,
    "output_dim": 32,
    "initializer_range": INIT_STD,
}
QWEN3_AUDIO = {
    **QWEN2_5_AUDIO,
    "n_window": 50,
    "n_window_infer": 800,
    "downsample_hidden_size": 8,
    "conv_chunksize": 500,
}
"""Tiny audio towers at the released mel bins, chunks and windows; each audio case changes one thing."""
QWEN3_OMNI_TEXT = {
    **QWEN3_TEXT,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "decoder_sparse_step": 1,
}
CLIPS = (450, 450, 137)
"""Mel frames per clip: two of one length (the negative control's pair), whole and partial chunks."""
GRIDS = ((1, 5, 3), (1, 5, 3), (2, 2, 4))
"""Items' (t, h, w) in merge windows: two images of one grid, then two frames."""


def _omni(model_type: str, vision: dict[str, Any], audio: dict[str, Any], out: Path) -> tuple[Any, Any]:
    """transformers' thinker of a tiny `model_type` checkpoint saved to `out` (the full model's config, no audio
    output: only `thinker.*` tensors), and Eric's towers loaded from it."""
    from transformers import AutoModelForMultimodalLM, Qwen2_5OmniConfig, Qwen3OmniMoeConfig

    text, config_class, towers = (
        (TEXT, Qwen2_5OmniConfig, Qwen2_5OmniTowers)
        if model_type == "qwen2_5_omni"
        else (QWEN3_OMNI_TEXT, Qwen3OmniMoeConfig, Qwen3OmniTowers)
    )
    thinker = {"audio_config": audio, "vision_config": vision, "text_config": text, "initializer_range": INIT_STD}
    model = saved_model(AutoModelForMultimodalLM, config_class(thinker_config=thinker, enable_audio_output=False), out)
    return model.thinker, towers.from_checkpoint(out)


def _check_vision(model_type: str, vision: dict[str, Any], audio: dict[str, Any], out: Path) -> None:
    thinker, ours = _omni(model_type, vision, audio, out)
    merge, row = vision["spatial_merge_size"], 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    grid = torch.tensor([(t, h * merge, w * merge) for t, h, w in GRIDS])
    pixels = torch.cat(random_rows([(int(g.prod()), row) for g in grid], seed=3))
    with torch.no_grad():
        out_hf = thinker.get_image_features(pixels, grid)
    levels = getattr(out_hf, "deepstack_features", None) or []
    refs = [torch.cat([rows, *(level[i] for level in levels)], dim=-1) for i, rows in enumerate(out_hf.pooler_output)]
    assert_rows_equal(ours.vision(pixels, grid).split(ours.visual.num_tokens(grid)), refs)


def _check_audio(model_type: str, vision: dict[str, Any], audio: dict[str, Any], out: Path) -> None:
    thinker, ours = _omni(model_type, vision, audio, out)
    clips = random_rows([(audio["num_mel_bins"], n) for n in CLIPS], seed=7)
    lengths = torch.tensor(CLIPS)
    padded = torch.zeros(len(CLIPS), audio["num_mel_bins"], max(CLIPS))
    for i, clip in enumerate(clips):
        padded[i, :, : clip.shape[1]] = clip
    mask = (torch.arange(max(CLIPS))[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        refs = thinker.get_audio_features(padded, mask).last_hidden_state
    rows = ours.audio_rows(lengths)
    assert_rows_equal(ours.audio(torch.cat([c.T for c in clips]), lengths).split(rows), refs.split(rows))


@pytest.mark.parametrize(
    "vision",
    varied(
        QWEN2_5_VL,
        {
            "patch_8": {"patch_size": 8, "window_size": 32},
            "merge_3": {"spatial_merge_size": 3, "window_size": 84},
            "window_28": {"window_size": 28},
            "depth_3_full_0_2": {"depth": 3, "fullatt_block_indexes": [0, 2]},
        },
    ),
)
def test_qwen2_5_omni_vision_follows_its_config(vision: dict[str, Any], tmp_path: Path) -> None:
    _check_vision("qwen2_5_omni", vision, QWEN2_5_AUDIO, tmp_path)


@pytest.mark.parametrize(
    "audio",
    varied(
        QWEN2_5_AUDIO,
        {
            "n_window_30": {"n_window": 30},
            "mel_80": {"num_mel_bins": 80},
            "positions_100": {"max_source_positions": 100},
            "one_layer_width_48": {"encoder_layers": 1, "d_model": 48, "encoder_attention_heads": 3},
        },
    ),
)
def test_qwen2_5_omni_audio_follows_its_config(audio: dict[str, Any], tmp_path: Path) -> None:
    _check_audio("qwen2_5_omni", QWEN2_5_VL, audio, tmp_path)


@pytest.mark.parametrize(
    "vision",
    varied(
        QWEN3_VL,
        {
            "grid_6x6": {"num_position_embeddings": 36},
            "grid_40_not_square": {"num_position_embeddings": 40},
            "grid_196_as_reported": {"num_position_embeddings": 196},
            "patch_8": {"patch_size": 8},
            "merge_3": {"spatial_merge_size": 3},
            "depth_2_tap_1": {"depth": 2, "deepstack_visual_indexes": [1]},
            "no_deepstack": {"deepstack_visual_indexes": []},
        },
    ),
)
def test_qwen3_omni_vision_follows_its_config(vision: dict[str, Any], tmp_path: Path) -> None:
    _check_vision("qwen3_omni_moe", vision, QWEN3_AUDIO, tmp_path)


@pytest.mark.parametrize(
    "audio",
    varied(
        QWEN3_AUDIO,
        {
            "attention_window_200": {"n_window_infer": 200},
            "conv_batches_of_2": {"conv_chunksize": 2},
            "downsample_16": {"downsample_hidden_size": 16},
            "mel_80": {"num_mel_bins": 80},
            "positions_20": {"max_source_positions": 20},
            "one_layer_width_48": {"encoder_layers": 1, "d_model": 48, "encoder_attention_heads": 3},
        },
    ),
)
def test_qwen3_omni_audio_follows_its_config(audio: dict[str, Any], tmp_path: Path) -> None:
    _check_audio("qwen3_omni_moe", QWEN3_VL, audio, tmp_path)


def test_qwen3_omni_with_a_non_square_grid_warms_up_as_transformers(tmp_path: Path) -> None:
    """The issue's path: a Qwen3-Omni checkpoint (processor and all) whose vision config has a 40-row position table
    (transformers reads its 6x6 square) loads on the generic path and its warm-up item (a grey 224x224 image
    through the processor) gives transformers' thinker's rows."""
    from transformers import AutoModelForMultimodalLM

    from eric_epd.checkpoints.audio_families import AUDIO_FAMILIES
    from eric_epd.checkpoints.saving import save_random_checkpoint
    from eric_epd.models.hf.tensors import unpack_tensors
    from eric_epd.models.registry import load_processor
    from eric_epd.testing.media import random_image
    from tests.support.generic_batches import generic_runner, run_batch

    family = AUDIO_FAMILIES["qwen3_omni_moe"]

    def make(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
        config, processor = family.make(tok, ids, vocab, init_std)
        config.thinker_config.vision_config.num_position_embeddings = 40
        return config, processor

    model = save_random_checkpoint(
        tmp_path, family.tokens, make, AutoModelForMultimodalLM, family.released, 0, INIT_STD
    )
    workload, runner = generic_runner(tmp_path)
    other = load_processor(tmp_path).process_image(random_image(224, 224, seed=5))  # the negative control
    items = [workload.warmup_item, other]
    refs = []
    for item in items:
        inputs = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        with torch.no_grad():
            out = model.thinker.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        refs.append(torch.cat([out.pooler_output[0], *(level[0] for level in out.deepstack_features)], dim=-1))
    assert_rows_equal(run_batch(workload, runner, items), refs)
