"""The model's own HF processor as Eric's modality processor for audio: decoded samples in, resampled to the feature
extractor's rate as vLLM resamples them, its features (e.g. Whisper log-mels and their mask) packed into one float32
frame, and the rows vLLM's placeholder holds for them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from PIL import Image

from eric_epd.media import resample as resampler
from eric_epd.models.hf.loader import hf_config
from eric_epd.models.hf.processor import (
    HFProcessedItem,
    checkpoint_processor,
    cost_of,
    placeholder_token,
    processor_fingerprint,
    thread_copy,
)
from eric_epd.models.hf.tensors import pack_tensors
from eric_epd.models.processor import BaseModalityProcessor

logger = logging.getLogger(__name__)


def valid_frames(out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen2.5-Omni: its processor pads every clip's log-mels to the extractor's 300 s, and its thinker reads only the
    frames the mask keeps (`get_audio_features` selects them, as vLLM's processor does before its tower): those
    frames, frame-major ([frames, mel bins], so clips of any length join along dim 0), and their count, named as
    vLLM names it."""
    mask = out["feature_attention_mask"].bool()
    return {"input_features": out["input_features"].permute(0, 2, 1)[mask], "audio_feature_lengths": mask.sum(-1)}


AUDIO_TENSORS: Mapping[str, Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = MappingProxyType(
    {
        "qwen2_5_omni": valid_frames,
        "qwen3_omni_moe": valid_frames,  # its processor pads to the longest clip: one clip is all valid frames
    }
)
"""HF model_type -> (the processor's output) -> an item's tensors, where they are not the processor's audio tensors
as they come (models/hf/audio_encoder.AUDIO_ROWS takes them back)."""
HOP_PADDED = frozenset({"qwen3_omni_moe"})
"""Families whose clips vLLM zero-pads to a whole number of hops before its processor (vLLM 0.32's
qwen3_omni_moe_thinker), so their clips keep every frame (ceil(samples / hop), not samples // hop); their features
then stop nowhere (`truncation=False`, the family's processor default). SGLang pads no clip: Eric's rows are vLLM's."""


def padded_to_hop(wave: np.ndarray, hop: int) -> np.ndarray:
    """`wave` zero-padded at its end to a whole number of `hop` samples, as vLLM pads a Qwen3-Omni clip."""
    return np.pad(wave, (0, -len(wave) % hop))


class HFAudioProcessor(BaseModalityProcessor):
    """Runs the checkpoint's processor on one audio item with the text that stands for one, as vLLM's model calls it
    (`sampling_rate` and `truncation=True`: Qwen2-Audio's features stop at the extractor's 30 s); the rows are the
    audio tokens it expands that text into. Thread-safe: each thread works on its own copy of the processor."""

    modalities = ("audio",)

    def __init__(self, model_dir: Path, values_per_cost: int | None = None) -> None:
        config = hf_config(model_dir)
        self._processor, extractor = checkpoint_processor(model_dir, "feature_extractor", "Eric's audio path")
        self.sampling_rate = int(extractor.sampling_rate)
        """The rate the feature extractor takes: every item is resampled to it first."""
        self._placeholder, self._token_id = placeholder_token(
            model_dir, self._processor, "audio_token", config, "audio_token_id", "audio goes"
        )
        text_names = set(self._processor.tokenizer.model_input_names)
        self._names = frozenset(n for n in self._processor.model_input_names if n not in text_names)
        self._tensors = AUDIO_TENSORS.get(config.model_type, self._processor_tensors)
        self._hop = int(extractor.hop_length) if config.model_type in HOP_PADDED else 0
        """Samples per hop a clip is zero-padded to a multiple of (HOP_PADDED), else 0: not padded, truncated."""
        self.values_per_cost = values_per_cost or audio_values_per_cost(extractor)
        """Input values per unit of an item's cost: audio_values_per_cost's, or the model's other unit (an Omni
        model's vision patch: one unit for all its items)."""
        self._local = threading.local()
        settings = self._processor.feature_extractor.to_dict()
        self._fingerprint = processor_fingerprint(
            Path(model_dir), self._processor, {k: v for k, v in settings.items() if k != "mel_filters"}
        )

    def _mine(self) -> Any:
        """This thread's copy of the processor."""
        return thread_copy(self._local, self._processor)

    def process_audio(self, samples: np.ndarray, sampling_rate: int, hop_padded: bool = True) -> HFProcessedItem:
        """Mono float32 samples at `sampling_rate` Hz (media/audio.decode_audio's), resampled as vLLM does
        (media/resample.py), through the checkpoint's own processor: its named tensors and the rows they give.
        `hop_padded=False`: a HOP_PADDED family's clip as SGLang 0.5.23 reads it (not padded, samples // hop frames,
        still never truncated)."""
        wave = resampler.resample(samples, int(sampling_rate), self.sampling_rate)
        if self._hop and hop_padded:
            wave = padded_to_hop(wave, self._hop)
        out = self._mine()(
            text=[self._placeholder],
            audio=[wave],
            sampling_rate=self.sampling_rate,
            truncation=not self._hop,
            return_tensors="pt",
        )
        rows = int((out["input_ids"] == self._token_id).sum())
        if rows < 1:
            raise ValueError(
                f"the audio ({samples.shape[-1]} samples at {sampling_rate} Hz) is too short to give "
                "the model any audio token"
            )
        specs, frame = pack_tensors(self._tensors(out))
        mask = out.get("feature_attention_mask")  # the processor's own, whatever the item keeps of it
        return HFProcessedItem(
            "audio",
            frame,
            (1, 1, rows),
            rows,
            tensors=specs,  # type: ignore[arg-type]
            cost=cost_of(frame.size, self.values_per_cost),
            feature_frames=int(mask.sum()) if isinstance(mask, torch.Tensor) else None,
        )

    def _processor_tensors(self, out: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The processor's audio tensors as they come (its feature extractor's, e.g. log-mels and their mask)."""
        return {k: v for k, v in out.items() if k in self._names and isinstance(v, torch.Tensor)}

    def process_image(self, image: Image.Image) -> HFProcessedItem:
        """Not served: this checkpoint's Eric encodes audio only."""
        raise ValueError("this model's Eric encodes audio only")

    def process_video(
        self, frames: np.ndarray, sampled_fps: float = 2.0, seconds: Sequence[float] | None = None
    ) -> HFProcessedItem:
        """Not served: this checkpoint's Eric encodes audio only."""
        raise ValueError("this model's Eric encodes audio only")

    def fingerprint(self, modality: str) -> bytes:
        """What names the processor's output in content hashes: its files and effective feature-extractor settings,
        the resampler and the rate it resamples to."""
        padding = f"|hop-padded {self._hop}" if self._hop else ""
        return self._fingerprint + f"|{resampler.METHOD}|{self.sampling_rate}{padding}".encode()


def audio_values_per_cost(extractor: Any) -> int:
    """Float32 values per unit of an audio item's cost: a mel frame pair (`feature_size` x 2), so the batch cap
    (--max-batch-patches) counts the audio encoder's positions after its stride-2 convolution, as it counts a vision
    tower's patches."""
    return 2 * int(getattr(extractor, "feature_size", 0) or 80)
