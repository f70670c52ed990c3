"""Tiny checkpoints whose tower configs differ from the released models', and the check that Eric's tower gives
transformers' rows on them: a model built by transformers from a config (random weights, its constant parameters
jittered so every one matters) and saved as transformers saves it, and the row comparison with its negative control.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eric_epd.checkpoints.saving import jitter_constants
from tests.support.generic_batches import relative_error

RTOL = 1e-5
"""Worst relative error (max |Eric's - transformers'| / max |transformers'|) in float32: the same modules on the same
inputs (the Omni and generic tests' bound)."""
MISMATCH = 1e-2
"""The negative control: another item's rows (same shape, other pixels or samples) are at least this far off, so the
comparison above tells rows apart."""
INIT_STD = 0.1
"""Random weights' spread (the tiny checkpoints' own): large enough that every layer moves the rows."""

TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "initializer_range": INIT_STD,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2]},
}
"""A one-layer language model of width 32 (16-wide heads: the rotary half split 4/2/2 over t, h, w)."""
QWEN3_TEXT = {**TEXT, "rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": True}}
QWEN3_5_TEXT = {
    **TEXT,
    "layer_types": ["full_attention"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
}

QWEN2_VL = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 32,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "initializer_range": INIT_STD,
}
QWEN2_5_VL = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "hidden_act": "silu",
    "initializer_range": INIT_STD,
}
QWEN3_VL = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1],
    "hidden_act": "gelu_pytorch_tanh",
    "initializer_range": INIT_STD,
}
QWEN3_5 = {key: value for key, value in QWEN3_VL.items() if key != "deepstack_visual_indexes"}
"""The tiny Qwen vision towers each case changes (the released ones: 14- or 16-pixel patches merged 2x2, 32 or 27
blocks, 112-pixel windows, a 48x48 position grid, DeepStack after blocks 8, 16 and 24)."""


def saved_model(auto_class: Any, config: Any, out: Path, seed: int = 0) -> torch.nn.Module:
    """A float32 transformers model of `config` (built by `auto_class`, an Auto class or the model's own; constants
    jittered), saved to `out` with save_pretrained: config.json and safetensors as transformers writes them. Returns
    the model, in eval mode."""
    torch.manual_seed(seed)
    build = getattr(auto_class, "from_config", None) or auto_class._from_config  # an Auto class, or a model class
    model = build(config).to(torch.float32).eval()
    jitter_constants(model, INIT_STD)
    model.save_pretrained(out)
    return model


def random_rows(shapes: Sequence[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    """One standard-normal float32 tensor per shape (an item's preprocessed input), seeded from `seed` up."""
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)) for i, shape in enumerate(shapes)]


def assert_rows_equal(ours: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> None:
    """Each item's rows equal transformers' within RTOL; items 0 and 1 share a shape, and item 0's rows are MISMATCH
    or more off item 1's reference (wrong rows fail the same comparison)."""
    assert len(ours) == len(refs) >= 2
    for i, (mine, ref) in enumerate(zip(ours, refs, strict=True)):
        assert mine.shape == ref.shape, f"item {i}: {tuple(mine.shape)} vs transformers' {tuple(ref.shape)}"
        error = relative_error(mine, ref)
        assert error <= RTOL, f"item {i}: relative error {error:.2e}"
    assert ours[0].shape == refs[1].shape
    assert relative_error(ours[0], refs[1]) > MISMATCH, "another item's rows pass the comparison"


def varied(base: dict[str, Any], changes: dict[str, dict[str, Any]]) -> list[Any]:
    """pytest params: `base` updated by each of `changes` (named by its key)."""
    import pytest

    return [pytest.param({**base, **change}, id=name) for name, change in changes.items()]
