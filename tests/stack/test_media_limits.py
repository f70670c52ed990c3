"""vLLM's --limit-mm-per-prompt as the launcher builds it from a checkpoint's config.json: images and a video for
every model (or vision chunks for Kimi-K2.5), and clips where the model (or its Omni thinker) has an audio tower (as
many videos as clips where its videos bring their soundtracks); and
--trust-request-mm-kwargs only for the models whose videos bring their soundtracks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eric_epd.stack.servers import AUDIO_LIMIT, media_limits, soundtrack_flags


@pytest.mark.parametrize(
    ("config", "limits"),
    [
        ({"model_type": "qwen2_vl", "vision_config": {}}, {"image": 4, "video": 1}),
        (
            {"model_type": "qwen2_audio", "audio_config": {"d_model": 64}},
            {"image": 4, "video": 1, "audio": AUDIO_LIMIT},
        ),
        (
            {"model_type": "qwen2_5_omni", "thinker_config": {"audio_config": {"d_model": 64}, "vision_config": {}}},
            {"image": 4, "video": AUDIO_LIMIT, "audio": AUDIO_LIMIT},
        ),  # each video may bring its soundtrack
        ({"model_type": "gemma4", "audio_config": None, "vision_config": {}}, {"image": 4, "video": 1}),
        ({"model_type": "kimi_k25", "use_unified_vision_chunk": True}, {"vision_chunk": 5}),
    ],
)
def test_media_limits_follow_the_config(tmp_path: Path, config: dict, limits: dict[str, int]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert media_limits(tmp_path) == limits


@pytest.mark.parametrize(
    ("model_type", "flags"),
    [
        ("qwen2_5_omni", ("--trust-request-mm-kwargs",)),
        ("qwen3_omni_moe", ("--trust-request-mm-kwargs",)),
        ("qwen2_audio", ()),
        ("qwen2_vl", ()),
        ("gemma4", ()),
    ],
)
def test_only_omni_engines_take_per_request_processor_options(
    tmp_path: Path, model_type: str, flags: tuple[str, ...]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert soundtrack_flags(tmp_path) == flags
