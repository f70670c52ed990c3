"""vLLM's own audio path (no engine started) on the tiny Qwen2-Audio: its chat media loader and multimodal processor
give, for each clip's bytes, the features Eric's item holds and a placeholder with as many embedding positions as
Eric's rows, and the family's chat template puts the placeholder where vLLM looks for it. vLLM resamples with
torchaudio, which this venv cannot load (setup.sh), so the clips are at the model's 16 kHz; Eric's resampler is
checked against the formula in tests/media/test_audio.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eric_epd.eric.processor import Processor
from eric_epd.media.limits import MediaLimits
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.models.registry import load_processor
from eric_epd.testing.media import audio_bytes

pytestmark = pytest.mark.exactness

CLIPS = (("wav", 2 * 16000 + 1, 1), ("flac", 16000 + 333, 2), ("mp3", 3 * 16000 + 7, 2), ("ogg", 31 * 16000, 1))
"""(format, frames at 16 kHz, channels): odd lengths, stereo, and a clip past the extractor's 30 s."""


def test_vllms_features_and_placeholders_are_erics(qwen2_audio_tiny: Path) -> None:
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.media.audio import AudioMediaIO

    vllm_processor = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=str(qwen2_audio_tiny), tokenizer=str(qwen2_audio_tiny), dtype="float32", max_model_len=4096)
    )
    prompt = AutoTokenizer.from_pretrained(qwen2_audio_tiny).apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" in prompt
    eric = Processor(load_processor(qwen2_audio_tiny), MediaLimits(), 1, b"test")
    try:
        for fmt, frames, channels in CLIPS:
            data = audio_bytes(frames, 16000, channels, fmt, seed=frames)
            audio = AudioMediaIO().load_bytes(data)  # what vLLM's chat parser makes of the part's bytes
            processed = vllm_processor(prompt, vllm_processor.info.parse_mm_data({"audio": [audio]}))
            (placeholder,) = processed["mm_placeholders"]["audio"]
            item = eric._prepare_sync("audio", data).item
            assert placeholder.get_num_embeds() == item.num_tokens, fmt
            ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
            fields = processed["mm_kwargs"]["audio"][0]
            assert {"input_features", "feature_attention_mask"} <= set(fields)
            for name in ("input_features", "feature_attention_mask"):
                theirs = fields[name].data
                mine = ours[name].reshape(theirs.shape).to(theirs.dtype)  # vLLM keeps one item without its batch dim
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=f"{name} {fmt}")
    finally:
        eric.close()


def test_vllms_omni_features_and_placeholders_are_erics(qwen2_5_omni_tiny: Path) -> None:
    """Qwen2.5-Omni: vLLM's processor hands its tower each clip's valid log-mel frames (`input_audio_features`,
    [mel bins, frames]) and their count, which Eric's item holds frame-major, and its placeholder (the audio tokens
    of `<|audio_bos|><|AUDIO|><|audio_eos|>` in the chat template) has as many embedding positions as Eric's rows."""
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.media.audio import AudioMediaIO

    vllm_processor = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=str(qwen2_5_omni_tiny), tokenizer=str(qwen2_5_omni_tiny), dtype="float32", max_model_len=4096)
    )
    prompt = AutoTokenizer.from_pretrained(qwen2_5_omni_tiny).apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>" in prompt
    eric = Processor(load_processor(qwen2_5_omni_tiny), MediaLimits(), 1, b"test")
    try:
        for fmt, frames, channels in CLIPS:
            data = audio_bytes(frames, 16000, channels, fmt, seed=frames)
            processed = vllm_processor(
                prompt, vllm_processor.info.parse_mm_data({"audio": [AudioMediaIO().load_bytes(data)]})
            )
            (placeholder,) = processed["mm_placeholders"]["audio"]
            item = eric._prepare_sync("audio", data).item
            assert placeholder.get_num_embeds() == item.num_tokens, fmt
            ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
            fields = processed["mm_kwargs"]["audio"][0]
            torch.testing.assert_close(
                ours["input_features"].T, fields["input_audio_features"].data, rtol=0, atol=1e-6, msg=fmt
            )
            assert ours["audio_feature_lengths"].tolist() == [int(fields["audio_feature_lengths"].data)], fmt
    finally:
        eric.close()
