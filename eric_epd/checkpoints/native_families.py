"""Tiny (model config, processor) makers for the generic families whose towers patch each image at its own
resolution: Mistral 3 (Pixtral), GLM-4.1V and GLM-4.5V, Gemma 4 (checkpoints/families.py; Kimi-K2.5: kimi.py)."""

from __future__ import annotations

from typing import Any

from eric_epd.checkpoints.text_parts import NEWLINES, Tokens, _text

MISTRAL3 = Tokens(
    ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    {"image_token": "[IMG]"},
    bos="<s>",
    eos="</s>",
    pad="<unk>",
)


def make_mistral3(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Pixtral 16-pixel patches merged 2x2: one token per 32x32 pixels, images up to 128 pixels a side."""
    from transformers import Mistral3Config, PixtralImageProcessor, PixtralProcessor

    cfg = Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 32,
            "image_size": 128,
            "patch_size": 16,
            "initializer_range": init_std,
        },
        text_config={"model_type": "mistral", **_text(vocab, ids, MISTRAL3, init_std)},
        spatial_merge_size=2,
        vision_feature_layer=-1,
        image_token_index=ids["[IMG]"],
        multimodal_projector_bias=False,
    )
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    improc = PixtralImageProcessor(size={"longest_edge": 128}, patch_size={"height": 16, "width": 16})
    return cfg, PixtralProcessor(improc, tok, patch_size=16, spatial_merge_size=2)


GLM4V = Tokens(
    (
        "<|endoftext|>",
        "[gMASK]",
        "<sop>",
        "<|user|>",
        "<|assistant|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
        "<|video|>",
    ),
    {"image_token": "<|image|>", "video_token": "<|video|>"},
    eos="<|endoftext|>",
)


GLM45V_MOE = {
    "model_type": "glm4v_moe_text",
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "use_qk_norm": False,
}
"""GLM-4.5V's language model: GLM-4.1V's with a mixture of 2 experts after its first (dense) layer (vLLM reads
`use_qk_norm`, which transformers' config does not define)."""


def make_glm4v(tok: Any, ids: dict[str, int], vocab: int, init_std: float, moe: bool = False) -> tuple[Any, Any]:
    """GLM-4.1V's tower at 14-pixel patches merged 2x2, 56x56 to 112x112 pixels per image (GLM-4.5V: the same tower
    and processor before a mixture-of-experts language model)."""
    import transformers
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}
    text = _text(vocab, ids, GLM4V, init_std, rope_parameters=rope, **(GLM45V_MOE if moe else {}))
    name = "Glm4vMoe" if moe else "Glm4v"
    cfg = getattr(transformers, f"{name}Config")(
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "out_hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "image_size": 56,
            "initializer_range": init_std,
        },
        text_config=text,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )
    cfg.architectures = [f"{name}ForConditionalGeneration"]
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    improc = Glm4vImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    video = Glm4vVideoProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    return cfg, Glm4vProcessor(improc, tok, video)


GEMMA4 = Tokens(
    (
        "<pad>",
        "<eos>",
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<|image>",
        "<|image|>",
        "<image|>",
        "<|video|>",
        "<|audio>",
        "<|audio|>",
        "<audio|>",
    ),
    {
        "boi_token": "<|image>",
        "image_token": "<|image|>",
        "eoi_token": "<image|>",
        "boa_token": "<|audio>",
        "audio_token": "<|audio|>",
        "eoa_token": "<audio|>",
    },
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    plain=NEWLINES,
)


def make_gemma4(tok: Any, ids: dict[str, int], vocab: int, init_std: float) -> tuple[Any, Any]:
    """Gemma 4's tower at 16-pixel patches pooled 2x2, at most 70 soft tokens an image (its smallest budget); no
    audio tower."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    cfg = Gemma4Config(
        text_config={
            **_text(vocab, ids, GEMMA4, init_std),
            "vocab_size_per_layer_input": vocab,
            "hidden_size_per_layer_input": 8,
            "sliding_window": 64,
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "pooling_kernel_size": 2,
            "patch_size": 16,
            "position_embedding_size": 64,
            "default_output_length": 70,
            "initializer_range": init_std,
        },
        audio_config=None,
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"],
        initializer_range=init_std,
    )
    cfg.architectures = ["Gemma4ForConditionalGeneration"]
    improc = Gemma4ImageProcessor(patch_size=16, max_soft_tokens=70, pooling_kernel_size=2)
    video = Gemma4VideoProcessor(patch_size=16, max_soft_tokens=70, pooling_kernel_size=2)
    return cfg, Gemma4Processor(Gemma4AudioFeatureExtractor(), improc, tok, video, image_seq_length=70)
