"""Eric's other hand-written towers follow their checkpoint's config: Qwen2-Audio's (models/qwen2_audio.py), Gemma
3's (models/gemma3.py) and InternVL's (models/internvl.py), each on tiny checkpoints built and saved by transformers
whose tower config differs from the released one in one thing at a time (mel bins, positional table, width, depth;
image and patch sizes, pooled tokens, pixel-shuffle ratio, feature layer, norms, biases), give transformers' rows on
the same inputs: the audio rows its language model receives, `get_image_features` for the image towers. Each batch
holds two items of one shape (the negative control: one's rows fail the comparison against the other's) and a third.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eric_epd.models.gemma3 import Gemma3VisionTower
from eric_epd.models.internvl import InternVLVisionTower
from eric_epd.models.qwen2_audio import Qwen2AudioTower, whisper_output_lengths
from tests.support.tower_cases import INIT_STD, assert_rows_equal, random_rows, saved_model, varied

QWEN2_TEXT = {
    "model_type": "qwen2",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "initializer_range": INIT_STD,
}
GEMMA3_TEXT = {
    **QWEN2_TEXT,
    "model_type": "gemma3_text",
    "head_dim": 16,
    "sliding_window": 64,
    "query_pre_attn_scalar": 16,
}
MEDIA_TOKEN = 5
"""The image or audio placeholder's id, inside the tiny vocabulary."""

QWEN2_AUDIO = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
    "initializer_range": INIT_STD,
}
SIGLIP = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 64,
    "patch_size": 16,
    "vision_use_head": False,
    "initializer_range": INIT_STD,
}
INTERNVIT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": [32, 32],
    "patch_size": [8, 8],
    "initializer_range": INIT_STD,
}
"""The tiny towers each case changes (the released ones: 128 mel bins, 1500 positions; SigLIP 896/14 pooled to 256
tokens; InternViT 448/14 shuffled by 0.5)."""
CLIPS = (150, 150, 61)
"""Valid mel frames per clip: two of one length (the negative control's pair) and a shorter one."""


@pytest.mark.parametrize(
    "audio",
    varied(
        QWEN2_AUDIO,
        {
            "mel_80": {"num_mel_bins": 80},
            "positions_100": {"max_source_positions": 100},
            "one_layer_width_48": {"encoder_layers": 1, "d_model": 48, "encoder_attention_heads": 3},
            "ffn_32_heads_4": {"encoder_ffn_dim": 32, "encoder_attention_heads": 4},
        },
    ),
)
def test_qwen2_audio_follows_its_config(audio: dict[str, Any], tmp_path: Path) -> None:
    """Rows equal what transformers' full model puts at its audio tokens (its forward, caught at the language
    model's input), the clips padded to the tower's 2 x max_source_positions frames as its processor pads them."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    config = Qwen2AudioConfig(audio_config=audio, text_config=QWEN2_TEXT, audio_token_id=MEDIA_TOKEN)
    model = saved_model(Qwen2AudioForConditionalGeneration, config, tmp_path)
    frames, lengths = 2 * audio["max_source_positions"], torch.tensor(CLIPS)
    features = torch.zeros(len(CLIPS), audio["num_mel_bins"], frames)
    for i, clip in enumerate(random_rows([(audio["num_mel_bins"], n) for n in CLIPS], seed=11)):
        features[i, :, : clip.shape[1]] = clip
    mask = (torch.arange(frames)[None, :] < lengths[:, None]).long()
    rows = whisper_output_lengths(lengths)[1].tolist()
    input_ids = torch.tensor([[MEDIA_TOKEN] * n + [0] * (max(rows) - n) for n in rows])
    caught: dict[str, torch.Tensor] = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kwargs: caught.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(
                input_ids=input_ids,
                input_features=features,
                feature_attention_mask=mask,
                attention_mask=(input_ids == MEDIA_TOKEN).long(),
            )
    finally:
        hook.remove()
    refs = caught["embeds"][input_ids == MEDIA_TOKEN].split(rows)
    ours = Qwen2AudioTower.from_checkpoint(tmp_path)(features, lengths).split(rows)
    assert_rows_equal(ours, refs)


def _image_rows(model: Any, tower: Any, size: int) -> None:
    """Three crops of `size` pixels through Eric's tower and transformers' get_image_features."""
    crops = random_rows([(3, size, size)] * 3, seed=13)
    with torch.no_grad():
        refs = model.get_image_features(torch.stack(crops)).pooler_output
    ours = tower(torch.stack(crops)).view(len(crops), -1, refs.shape[-1])
    assert_rows_equal(list(ours), list(refs))


@pytest.mark.parametrize(
    "case",
    varied(
        {"vision": SIGLIP, "tokens": 4},
        {
            "image_48_patch_8_tokens_9": {"vision": {**SIGLIP, "image_size": 48, "patch_size": 8}, "tokens": 9},
            "tokens_1": {"tokens": 1},
            "tokens_16_unpooled": {"tokens": 16},
            "depth_3": {"vision": {**SIGLIP, "num_hidden_layers": 3}},
            "heads_4_eps": {"vision": {**SIGLIP, "num_attention_heads": 4, "layer_norm_eps": 1e-3}},
        },
    ),
)
def test_gemma3_follows_its_config(case: dict[str, Any], tmp_path: Path) -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=GEMMA3_TEXT,
        vision_config=case["vision"],
        mm_tokens_per_image=case["tokens"],
        image_token_index=MEDIA_TOKEN,
        boi_token_index=6,
        eoi_token_index=7,
        initializer_range=INIT_STD,
    )
    model = saved_model(Gemma3ForConditionalGeneration, config, tmp_path)
    tower = Gemma3VisionTower.from_checkpoint(tmp_path)
    assert tower.tokens_per_image == case["tokens"]
    _image_rows(model, tower, case["vision"]["image_size"])


@pytest.mark.parametrize(
    "case",
    varied(
        {"vision": INTERNVIT},
        {
            "image_48": {"vision": {**INTERNVIT, "image_size": [48, 48]}},
            "image_64_ratio_quarter": {"vision": {**INTERNVIT, "image_size": [64, 64]}, "downsample_ratio": 0.25},
            "patch_4": {"vision": {**INTERNVIT, "patch_size": [4, 4]}},
            "feature_layer_-2": {"vision_feature_layer": -2},
            "feature_layer_1": {"vision_feature_layer": 1},
            "depth_3": {"vision": {**INTERNVIT, "num_hidden_layers": 3}},
            "qk_norm_bias": {"vision": {**INTERNVIT, "use_qk_norm": True, "attention_bias": True}},
            "rms_norm": {"vision": {**INTERNVIT, "norm_type": "rms_norm"}},
            "final_norm": {"vision": {**INTERNVIT, "use_mean_pooling": False}},
            "no_absolute_positions": {"vision": {**INTERNVIT, "use_absolute_position_embeddings": False}},
        },
    ),
)
def test_internvl_follows_its_config(case: dict[str, Any], tmp_path: Path) -> None:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    extra = {k: v for k, v in case.items() if k != "vision"}
    config = InternVLConfig(
        vision_config=case["vision"],
        text_config=QWEN2_TEXT,
        image_token_id=MEDIA_TOKEN,
        initializer_range=INIT_STD,
        **extra,
    )
    model = saved_model(InternVLForConditionalGeneration, config, tmp_path)
    _image_rows(model, InternVLVisionTower.from_checkpoint(tmp_path), case["vision"]["image_size"][0])


def test_left_out_top_level_keys_take_transformers_defaults() -> None:
    """Configs whose text_config leaves hidden_size out (and Gemma 3's, mm_tokens_per_image): rows as wide, and as
    many, as transformers' models give."""
    from transformers import Gemma3Config, InternVLConfig

    internvl = InternVLConfig(vision_config=INTERNVIT).to_dict()
    del internvl["text_config"]["hidden_size"]
    gemma3 = Gemma3Config(vision_config={**SIGLIP, "image_size": 256}).to_dict()  # 16x16 patches: 256 pool
    del gemma3["text_config"]["hidden_size"], gemma3["mm_tokens_per_image"]
    with torch.device("meta"):
        assert InternVLVisionTower(internvl).width == InternVLConfig().text_config.hidden_size
        tower = Gemma3VisionTower(gemma3)
    assert (tower.width, tower.tokens_per_image) == (
        Gemma3Config().text_config.hidden_size,
        Gemma3Config().mm_tokens_per_image,
    )


@pytest.mark.parametrize("table", ["qwen2_audio", "qwen2_5_omni_audio", "siglip", "internvit"])
def test_default_tables_are_transformers_own(table: str) -> None:
    """The values these towers take for keys a checkpoint leaves out are transformers' defaults (an [h, w] pair that
    transformers keeps is a square side here)."""
    from transformers import InternVLVisionConfig, Qwen2AudioEncoderConfig, SiglipVisionConfig
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig

    from eric_epd.models.gemma3 import SIGLIP_DEFAULTS
    from eric_epd.models.internvl import INTERNVIT_DEFAULTS
    from eric_epd.models.qwen2_5_omni import AUDIO_DEFAULTS
    from eric_epd.models.qwen2_audio import ENCODER_DEFAULTS

    ours, config_class = {
        "qwen2_audio": (ENCODER_DEFAULTS, Qwen2AudioEncoderConfig),
        "qwen2_5_omni_audio": (AUDIO_DEFAULTS, Qwen2_5OmniAudioEncoderConfig),
        "siglip": (SIGLIP_DEFAULTS, SiglipVisionConfig),
        "internvit": (INTERNVIT_DEFAULTS, InternVLVisionConfig),
    }[table]
    theirs = config_class().to_dict()
    square = {k: v[0] for k, v in theirs.items() if isinstance(v, list) and len(v) == 2 and v[0] == v[1]}
    assert dict(ours) == {k: square.get(k, theirs[k]) for k in ours}
