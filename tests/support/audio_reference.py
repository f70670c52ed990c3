"""Reference rows for audio tests: what transformers' full Qwen2-Audio model puts at its audio tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def transformers_audio_rows(model_dir: Path, clips: list[tuple[np.ndarray, int]]) -> list[torch.Tensor]:
    """Per (mono samples, sample rate) clip: resampled to 16 kHz as vLLM does, through the model's processor and its
    full model, the language model's input embeddings caught at the audio-token positions."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from eric_epd.media.resample import resample

    hf = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    caught: dict[str, torch.Tensor] = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kwargs: caught.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True
    )
    rows = []
    try:
        for samples, rate in clips:
            inputs = hf(
                text=["<|audio_bos|><|AUDIO|><|audio_eos|>"],
                audio=[resample(samples, rate, 16000)],
                sampling_rate=16000,
                truncation=True,
                return_tensors="pt",
            )
            with torch.no_grad():
                model(**inputs)
            rows.append(caught["embeds"][0][inputs["input_ids"][0] == model.config.audio_token_id])
    finally:
        hook.remove()
    return rows
