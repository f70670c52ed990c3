"""An Omni checkpoint (Qwen2.5-Omni, Qwen3-Omni) on Eric's generic path: its processor takes images and videos as
the generic image processor does and audio as the generic audio processor does, and one thinker, built without its
language model, encodes all three with transformers' own `get_image_features`, `get_video_features` and
`get_audio_features`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from eric_epd.common.widths import embedding_widths
from eric_epd.models.hf.audio import HFAudioProcessor
from eric_epd.models.hf.audio_encoder import HFAudioEncoder
from eric_epd.models.hf.encoder import HFVisionEncoder
from eric_epd.models.hf.loader import hf_config, load_vision_model
from eric_epd.models.hf.processor import HFImageProcessor, HFProcessedItem
from eric_epd.models.processor import BaseModalityProcessor

logger = logging.getLogger(__name__)


class HFOmniProcessor(BaseModalityProcessor):
    """The checkpoint's processor for images and videos (HFImageProcessor) and for audio (HFAudioProcessor), each
    with its own copies of it; every item's cost in the vision tower's input patches."""

    modalities = ("image", "video", "audio")

    def __init__(self, model_dir: Path) -> None:
        self._vision = HFImageProcessor(model_dir)
        self.values_per_cost = self._vision.values_per_cost
        """Input values per unit of any item's cost: one vision patch (an audio item counts its log-mel values in
        the same unit, so the batch cap means one thing for every item)."""
        self._audio = HFAudioProcessor(model_dir, values_per_cost=self.values_per_cost)

    @property
    def sampling_rate(self) -> int:
        """The rate the feature extractor takes."""
        return self._audio.sampling_rate

    def process_image(self, image: Image.Image) -> HFProcessedItem:
        """One image through the checkpoint's processor (HFImageProcessor.process_image)."""
        return self._vision.process_image(image)

    def process_video(
        self, frames: np.ndarray, sampled_fps: float = 2.0, seconds: Sequence[float] | None = None
    ) -> HFProcessedItem:
        """One video's sampled frames through the checkpoint's processor (HFImageProcessor.process_video)."""
        return self._vision.process_video(frames, sampled_fps, seconds)

    def process_audio(self, samples: np.ndarray, sampling_rate: int, hop_padded: bool = True) -> HFProcessedItem:
        """One clip through the checkpoint's processor (HFAudioProcessor.process_audio: the valid log-mel frames)."""
        return self._audio.process_audio(samples, sampling_rate, hop_padded)

    def frame_indices(self, total: int, src_fps: float) -> list[int] | None:
        """The frames vLLM's video loader for this checkpoint takes (HFImageProcessor.frame_indices)."""
        return self._vision.frame_indices(total, src_fps)

    def fingerprint(self, modality: str) -> bytes:
        """The fingerprint of the processor that takes `modality`."""
        return (self._audio if modality == "audio" else self._vision).fingerprint(modality)


class HFOmniEncoder:
    """One thinker (audio tower and vision tower, its language model never built) behind the vision encoder for
    images and videos and the audio encoder for audio."""

    def __init__(self, vision: HFVisionEncoder, audio: HFAudioEncoder) -> None:
        self.vision = vision
        self.audio = audio

    @property
    def model(self) -> torch.nn.Module:
        """The thinker both encoders run."""
        return self.vision.model

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> HFOmniEncoder:
        """The checkpoint's thinker towers, only their weights read, shared by both encoders."""
        config = hf_config(model_dir)
        model = load_vision_model(model_dir, dtype, device)
        widths = embedding_widths(config.to_dict())  # Qwen3-Omni's vision rows carry its DeepStack levels
        return cls(
            HFVisionEncoder(model, config.model_type, widths["image"], dtype),
            HFAudioEncoder(model, config.model_type, widths["audio"], dtype),
        )

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "image") -> list[torch.Tensor]:
        """Each item's [rows, width] output for a batch of one modality."""
        return (self.audio if modality == "audio" else self.vision).encode(inputs, rows, modality)
