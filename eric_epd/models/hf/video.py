"""vLLM 0.32's video loaders as Eric's generic path mirrors them: which source frames vLLM hands a family's processor
(the loader vLLM picks by the checkpoint's video processor class), so Eric's rows are those of vLLM's frames."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VideoSampling:
    """One of vLLM's video loaders, with the defaults vLLM calls it with (no `--media-io-kwargs` for video)."""

    loader: str = "uniform"
    """"uniform" (vllm/multimodal/video.py VideoBackend, "opencv"): `num_frames` spaced uniformly, all frames of a
    shorter video; "dynamic" (DynamicVideoBackend, "opencv_dynamic"): one frame every 1/`fps` seconds up to
    `max_duration`, else `fps * max_duration` spread over the whole video."""
    num_frames: int = 32
    """VideoMediaIO's default num_frames (the uniform loader's count; the dynamic loader ignores it)."""
    fps: float = 2.0
    """The dynamic loader's default fps."""
    max_duration: float = 300.0
    """The dynamic loader's default max_duration (seconds)."""
    resample_all: bool = False
    """vLLM's model hands the loader's `do_sample_frames` (true when every source frame was taken) to the HF
    processor, whose own `sample_frames` then samples those frames again (GLM-4.1V)."""

    def indices(self, total: int, src_fps: float, video_processor: Any) -> list[int]:
        """The source frames (of `total` at `src_fps`) whose pixels the processor ends up with in vLLM."""
        duration = total / src_fps  # vLLM's OpenCV decoder: frame count / fps
        picked = self._dynamic(total, src_fps, duration) if self.loader == "dynamic" else self._uniform(total)
        if not picked:
            raise ValueError(f"vLLM's {self.loader} video loader takes no frame from a {duration:.2f} s video")
        if self.resample_all and len(picked) == total:
            from transformers.video_utils import VideoMetadata

            metadata = VideoMetadata(total_num_frames=total, fps=src_fps, duration=duration)
            picked = [int(i) for i in video_processor.sample_frames(metadata)]
        return picked

    def _uniform(self, total: int) -> list[int]:
        """VideoBackend.compute_frames_index_to_sample (no fps limit)."""
        wanted = min(self.num_frames, total) if self.num_frames > 0 else total
        if wanted == total:
            return list(range(total))
        return np.linspace(0, total - 1, wanted, dtype=int).tolist()

    def _dynamic(self, total: int, src_fps: float, duration: float) -> list[int]:
        """DynamicVideoBackend.compute_frames_index_to_sample, expression for expression (Python ints throughout)."""
        last = total - 1
        if duration <= self.max_duration:
            n = math.floor(duration * self.fps)
            return sorted({min(last, math.ceil(i * src_fps / self.fps)) for i in range(n)})
        samples = int(self.max_duration * self.fps)
        if samples >= total:
            return list(range(total))
        seconds = np.linspace(0, duration, samples, endpoint=True)
        return sorted({min(last, math.ceil(t * src_fps)) for t in seconds})


VLLM_LOADERS: Mapping[str, VideoSampling] = MappingProxyType({
    "Glm4vVideoProcessor": VideoSampling("dynamic", resample_all=True),  # vLLM registers opencv_dynamic for it
})
"""The video processor classes vLLM 0.32 registers a loader for (VIDEO_LOADER_REGISTRY's video_processor=), among
the generic families whose videos Eric encodes; any other class gets vLLM's default loader (uniform, 32 frames)."""


def sampling_for(video_processor: Any) -> VideoSampling:
    """The loader vLLM uses for a checkpoint whose video processor is `video_processor`."""
    return VLLM_LOADERS.get(type(video_processor).__name__, VideoSampling())
