"""vLLM 0.32's video handling as Eric's generic path mirrors it: which source frames vLLM's loader takes (it picks the
loader by the checkpoint's video processor class) and how vLLM's model for the family calls the processor on them,
so Eric's rows are those of vLLM's frames."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
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
    `max_duration`, else `fps * max_duration` spread over the whole video; "qwen2_vl" (Qwen2VLVideoBackend):
    `fps` frames a second, 4 to 768 and an even count, spread over the whole video."""
    num_frames: int = 32
    """VideoMediaIO's default num_frames (the uniform loader's count; the dynamic loader ignores it)."""
    fps: float = 2.0
    """The dynamic loader's default fps."""
    max_duration: float = 300.0
    """The dynamic loader's default max_duration (seconds)."""

    def indices(self, total: int, src_fps: float) -> list[int]:
        """The source frames (of `total` at `src_fps`) vLLM's loader takes; ValueError where it takes none."""
        duration = total / src_fps  # vLLM's OpenCV decoder: frame count / fps
        if self.loader == "qwen2_vl":
            picked = self._qwen2_vl(total, src_fps)
        else:
            picked = self._dynamic(total, src_fps, duration) if self.loader == "dynamic" else self._uniform(total)
        if not picked:
            raise ValueError(f"vLLM's {self.loader} video loader takes no frame from a {duration:.2f} s video")
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

    def _qwen2_vl(self, total: int, src_fps: float) -> list[int]:
        """Qwen2VLVideoBackend.compute_frames_index_to_sample at its defaults (temporal patch 2, 4 to 768 frames,
        fps at most 30), with its float32 `torch.arange` step; none for a video of under two frames."""
        import torch

        patch, most = 2, math.floor(min(768, total) / 2) * 2
        n = min(max(total / src_fps * min(self.fps, 30), 4), most, total)
        n = math.floor(n / patch) * patch
        if n < 1:
            return []
        return torch.clamp(torch.arange(0, total, total / n).int(), max=total - 1).tolist()


VLLM_LOADERS: Mapping[str, VideoSampling] = MappingProxyType(
    {
        "Glm4vVideoProcessor": VideoSampling("dynamic"),  # vLLM registers opencv_dynamic for it
        "Qwen2VLVideoProcessor": VideoSampling("qwen2_vl"),  # vLLM registers qwen2_vl for it (Qwen2.5-Omni's videos)
    }
)
"""The video processor classes vLLM 0.32 registers a loader for (VIDEO_LOADER_REGISTRY's video_processor=), among
the generic families whose videos Eric encodes; any other class gets vLLM's default loader (uniform, 32 frames)."""


@dataclass(frozen=True)
class VllmVideoCall:
    """How vLLM's model for a family calls the HF processor on a loaded video (default: the frames alone, with the
    processor's own settings: LLaVA-OneVision)."""

    metadata: bool = False
    """It hands the loader's metadata with its `do_sample_frames` (true when every source frame was taken) to the
    processor, whose own `sample_frames` then samples those frames again (GLM-4.1V)."""
    image_size: bool = False
    """It rebuilds the video processor with the image processor's `size` (InternVL, vLLM's interns1.py)."""
    as_images: Mapping[str, Any] | None = None
    """It runs the frames through the processor's image path, as PIL images, with these kwargs (Gemma 4, whose
    model has no video tower: `max_soft_tokens=70`, vLLM's gemma4_mm.py _VIDEO_MAX_SOFT_TOKENS); None: the
    processor's video path."""


VLLM_CALLS: Mapping[str, VllmVideoCall] = MappingProxyType(
    {
        "glm4v": VllmVideoCall(metadata=True),
        "glm4v_moe": VllmVideoCall(metadata=True),  # GLM-4.5V: GLM-4.1V's processor and vLLM model code
        "internvl": VllmVideoCall(image_size=True),
        "gemma4": VllmVideoCall(as_images=MappingProxyType({"max_soft_tokens": 70})),
    }
)
"""model_type -> how vLLM's model calls the processor on a video, where it departs from the default."""


@dataclass(frozen=True)
class VideoPlan:
    """A family's videos as vLLM takes them: the loader, then the processor call."""

    sampling: VideoSampling
    call: VllmVideoCall

    @classmethod
    def of(cls, model_type: str, video_processor_name: str | None) -> VideoPlan:
        """The plan for a checkpoint of `model_type` for which vLLM names the video processor class
        `video_processor_name` (vllm_video_processor_name: what picks its loader)."""
        return cls(
            VLLM_LOADERS.get(video_processor_name or "", VideoSampling()), VLLM_CALLS.get(model_type, VllmVideoCall())
        )

    def frame_indices(self, total: int, src_fps: float, video_processor: Any) -> list[int]:
        """The source frames whose pixels the processor ends up with in vLLM: the loader's, sampled again by the
        processor where vLLM lets it (every frame taken, metadata handed over)."""
        picked = self.sampling.indices(total, src_fps)
        if self.call.metadata and len(picked) == total:
            from transformers.video_utils import VideoMetadata

            metadata = VideoMetadata(total_num_frames=total, fps=src_fps, duration=total / src_fps)
            picked = [int(i) for i in video_processor.sample_frames(metadata)]
        return picked


def vllm_video_processor_name(model_dir: Path, model_type: str) -> str | None:
    """The video processor class name vLLM 0.32 picks a checkpoint's loader by
    (`get_video_processor_cls_name_from_config`): `video_processor_type` in video_preprocessor_config.json or
    preprocessor_config.json, else transformers' model_type mapping (a GLM-4.5V checkpoint without either file gets
    vLLM's default loader, not GLM-4.1V's)."""
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            config = json.loads(path.read_text())
            if "video_processor_type" in config:
                return config["video_processor_type"]
    mapped = VIDEO_PROCESSOR_MAPPING_NAMES.get(model_type)
    return mapped.get("torchvision") if isinstance(mapped, dict) else mapped
