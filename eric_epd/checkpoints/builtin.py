"""Offline builders of tiny and small random Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoints, saved like a
Hugging Face repo.

Used by tests, benchmarks and as Eric's default model; nothing is downloaded. Deterministic by seed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from eric_epd.checkpoints.qwen_configs import CheckpointSpec, model_config

logger = logging.getLogger(__name__)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
SIZES = ("tiny", "small", "shaped3b", "shaped7b")
SHAPED = ("shaped3b", "shaped7b")
"""Benchmark sizes of qwen2_5_vl whose per-token costs have the released 3B's and 7B's ratios (planning/costs.py)."""
BUILDER_VERSION = 4  # bump when the output of build_checkpoint changes

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or content['type'] == 'image_url' or content['type'] == 'image_embeds' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or content['type'] == 'video_url' %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Describe this image. What is in the picture? A cat, a dog, a red square.",
    "Compare these images. What changed between the frames of the video?",
    "You are a helpful assistant. system user assistant",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_/\\",
]


def spec_for(family: str, size: str) -> CheckpointSpec:
    """The fixed sizes of a (family, size) pair."""
    if family not in FAMILIES or size not in SIZES or (size in SHAPED and family != "qwen2_5_vl"):
        raise ValueError(
            f"unknown checkpoint {family}/{size}; families {FAMILIES}, sizes {SIZES} (shaped sizes: qwen2_5_vl only)"
        )
    if size in SHAPED:  # one tower (6 blocks of 384, 2 of them full attention); the 7B shape has a deeper LM
        return CheckpointSpec(
            family,
            size,
            1024,
            3 if size == "shaped3b" else 7,
            16,
            2,
            6,
            384,
            6,
            1024,
            56 * 56,
            14 * 14 * 4 * 1280,
            text_mlp=5504,
        )
    if size == "tiny":  # Qwen3-VL: 4 blocks, so two DeepStack taps sit before the last block
        return CheckpointSpec(
            family, size, 128, 2, 2, 1, 4 if family.startswith("qwen3") else 2, 64, 2, 128, 56 * 56, 224 * 224
        )
    # small: real patch/merge sizes and pixel budget, 8 blocks of width 512 (31 M vision params)
    return CheckpointSpec(family, size, 512, 2, 8, 2, 8, 512, 8, 2048, 56 * 56, 14 * 14 * 4 * 1280)


def build_tokenizer(vocab_size: int = 512):  # -> PreTrainedTokenizerFast
    """Train a byte-level BPE tokenizer offline with Qwen's special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIALS[1:],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _save_processor(out: Path, spec: CheckpointSpec) -> None:
    from transformers import Qwen2VLImageProcessorPil

    processor_class = {
        "qwen2_vl": "Qwen2VLProcessor",
        "qwen2_5_vl": "Qwen2_5_VLProcessor",
        "qwen3_vl": "Qwen3VLProcessor",
        "qwen3_vl_moe": "Qwen3VLProcessor",
        "qwen3_5": "Qwen3VLProcessor",
        "qwen3_5_moe": "Qwen3VLProcessor",
    }[spec.family]
    qwen3 = spec.family.startswith("qwen3")
    patch = 16 if qwen3 else 14
    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if qwen3 else {}
    improc = Qwen2VLImageProcessorPil(size=size, patch_size=patch, temporal_patch_size=2, merge_size=2, **norm)
    improc.save_pretrained(out)
    pp = out / "preprocessor_config.json"
    d = json.loads(pp.read_text())
    d.update(
        processor_class=processor_class,
        image_processor_type="Qwen2VLImageProcessor",
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
    )
    pp.write_text(json.dumps(d, indent=2))
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor",
        "processor_class": processor_class,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": d["image_mean"],
        "image_std": d["image_std"],
        "size": size,
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "do_sample_frames": False,
        "fps": 2.0,
        "min_frames": 4,
        "max_frames": 768,
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def build_checkpoint(
    out_dir: str | os.PathLike, family: str = "qwen2_vl", size: str = "tiny", seed: int = 0, init_std: float = 0.1
) -> Path:
    """Write a complete random checkpoint (config, safetensors, tokenizer, processor configs) to out_dir."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    spec = spec_for(family, size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    vocab = ((len(tok) + 63) // 64) * 64
    cfg = model_config(spec, ids, vocab, init_std)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    if family == "qwen3_vl_moe":
        _experts_to_hub_layout(out)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out)
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.update(tokenizer_class="Qwen2Tokenizer", chat_template=CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc, indent=2))
    _save_processor(out, spec)
    n = sum(p.numel() for p in model.parameters())
    logger.info("built %s/%s checkpoint at %s: %.2fM params", family, size, out, n / 1e6)
    return out


def _experts_to_hub_layout(out: Path) -> None:
    """Store Qwen3-VL-MoE's fused experts as the released checkpoints do ([experts, in, out], the transpose of
    transformers' parameters). transformers transposes them back on load only where the shapes tell which is which
    (so the builder keeps neither matrix square), and vLLM reads exactly this layout."""
    from safetensors.torch import load_file, save_file

    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name] = t.transpose(1, 2).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})


def cache_root() -> Path:
    """Where built checkpoints are cached ($ERIC_EPD_CACHE or ~/.cache/eric-epd)."""
    return Path(os.environ.get("ERIC_EPD_CACHE", Path.home() / ".cache" / "eric-epd"))


def ensure_checkpoint(family: str = "qwen2_vl", size: str = "tiny", seed: int = 0) -> Path:
    """Return the cached checkpoint for (family, size, seed), building it atomically on first use."""
    return ensure_built(
        f"{family}-{size}-s{seed}-v{BUILDER_VERSION}",
        "config.json",
        lambda out: build_checkpoint(out, family, size, seed),
    )


def ensure_built(name: str, marker: str, build: Callable[[Path], object]) -> Path:
    """The cache directory `name`, built by `build` into a temporary directory and renamed into place on first use
    (so a half-built one is never seen); `marker` is a file every finished build holds."""
    target = cache_root() / name
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
