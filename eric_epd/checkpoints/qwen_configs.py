"""The built-in Qwen checkpoints' model configs (checkpoints/builtin.py): the sizes of one (family, size) and the
transformers config of Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and -MoE) or Qwen3.5 (and -MoE) built from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointSpec:
    """Sizes of one checkpoint: a language model just big enough to run, and the vision tower under test."""

    family: str
    size: str
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    vision_depth: int
    vision_width: int
    vision_heads: int
    vision_mlp: int
    min_pixels: int
    max_pixels: int
    text_mlp: int = 0
    """the language model's intermediate size (0: twice its width)"""


def _deepstack_layers(depth: int) -> list[int]:
    """DeepStack taps: blocks 1 and 2 of a tiny tower, then every quarter (as the released models space them)."""
    return [1, 2] if depth <= 4 else [depth // 4, depth // 2, 3 * depth // 4]


def _qwen3_vl_config(spec: CheckpointSpec, text_config: dict, common: dict, init_std: float):
    """Qwen3-VL, or with family qwen3_vl_moe its MoE sibling (the same tower, 4 experts of which 2 per token)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    head_dim = spec.text_hidden // spec.text_heads
    hw = (head_dim // 2) * 5 // 16  # Qwen3-VL's interleaved split: [24, 20, 20] for head_dim 128
    text_config = {
        **text_config,
        "head_dim": head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [head_dim // 2 - 2 * hw, hw, hw],
            "mrope_interleaved": True,
        },
    }
    vision = {**_qwen3_tower(spec, init_std), "deepstack_visual_indexes": _deepstack_layers(spec.vision_depth)}
    if spec.family == "qwen3_vl_moe":
        text_config = {
            **text_config,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": spec.text_hidden * 3 // 8,
            "tie_word_embeddings": False,
            "norm_topk_prob": True,
        }
        cfg = Qwen3VLMoeConfig(text_config=text_config, vision_config=vision, **common)
        cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]
        return cfg
    cfg = Qwen3VLConfig(text_config=text_config, vision_config=vision, **common)
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    return cfg


def _qwen3_tower(spec: CheckpointSpec, init_std: float) -> dict:
    """The vision config Qwen3-VL and Qwen3.5 share (16-pixel patches merged 2x2, two frames a temporal patch)."""
    return dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_width,
        intermediate_size=spec.vision_mlp,
        out_hidden_size=spec.text_hidden,
        num_heads=spec.vision_heads,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=64 if spec.size == "tiny" else 2304,
        initializer_range=init_std,
    )


def _qwen3_5_config(spec: CheckpointSpec, text_config: dict, common: dict, init_std: float):
    """Qwen3.5: Qwen3-VL's tower without DeepStack; a hybrid language model (one linear-attention layer, one full);
    qwen3_5_moe: the same with a mixture of experts (4 experts and one shared expert). Every token takes all four:
    served in bfloat16 (vLLM's only CPU path for the linear attention), a random router choosing 2 of 4 flips on
    last-bit differences between two correct towers, and greedy tokens then part for no fault of either."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 8  # partial_rotary_factor 0.25, as the released models: [11, 11, 10] for head_dim 256
    rope = {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [-(-half // 3), -(-half // 3), half - 2 * -(-half // 3)],
        "mrope_interleaved": True,
    }
    text_config = {
        **text_config,
        "head_dim": head_dim,
        "rope_parameters": rope,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
    }
    vision = _qwen3_tower(spec, init_std)
    if spec.family == "qwen3_5_moe":
        text_config = {
            **text_config,
            "num_experts": 4,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": spec.text_hidden,
            "shared_expert_intermediate_size": spec.text_hidden,
        }
        cfg = Qwen3_5MoeConfig(text_config=text_config, vision_config=vision, **common)
        cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        return cfg
    cfg = Qwen3_5Config(text_config=text_config, vision_config=vision, **common)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def model_config(spec: CheckpointSpec, ids: dict[str, int], vocab: int, init_std: float):
    """The transformers config of `spec`'s checkpoint, its special tokens at `ids` and `vocab` tokens in all."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    head_dim = spec.text_hidden // spec.text_heads
    hw = 3 * head_dim // 16  # Qwen's split of the rotary half-dim over (t, h, w): 16/24/24 for head_dim 128
    text_config = dict(
        vocab_size=vocab,
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp or 2 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [head_dim // 2 - 2 * hw, hw, hw],
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    if spec.family in ("qwen3_vl", "qwen3_vl_moe"):
        return _qwen3_vl_config(spec, text_config, common, init_std)
    if spec.family in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5_config(spec, text_config, common, init_std)
    if spec.family == "qwen2_vl":
        vision = dict(
            depth=spec.vision_depth,
            embed_dim=spec.vision_width,
            hidden_size=spec.text_hidden,
            num_heads=spec.vision_heads,
            mlp_ratio=spec.vision_mlp // spec.vision_width,
            in_channels=3,
            in_chans=3,  # the released configs carry both names; SGLang's Qwen2-VL reads this one
            patch_size=14,
            spatial_patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=init_std,
        )
        cfg = Qwen2VLConfig(text_config=text_config, vision_config=vision, **common)
        cfg.architectures = ["Qwen2VLForConditionalGeneration"]
    else:
        depth = spec.vision_depth  # keep windowed blocks in every size: tiny has one of each kind
        full = [depth - 1] if depth < 4 else [depth // 2 - 1, depth - 1]
        vision = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_width,
            intermediate_size=spec.vision_mlp,
            out_hidden_size=spec.text_hidden,
            num_heads=spec.vision_heads,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=full,
            hidden_act="silu",
            initializer_range=init_std,
        )
        cfg = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision, **common)
        cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg
