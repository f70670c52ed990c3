"""References for videos on SGLang's protocol: the frames SGLang's own Qwen-VL processor hands transformers'
processor (SGLang's preprocess_video: its decoder, frame count and first resize), and transformers' rows for them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch


def sglang_prepared_frames(data: bytes) -> tuple[np.ndarray, dict]:
    """uint8 (T, H, W, 3) frames and the metadata SGLang 0.5.23's own `preprocess_video` makes of the video `data`."""
    from sglang.srt.multimodal.processors.qwen_vl import preprocess_video
    from sglang.srt.utils.video_decoder import VideoDecoderWrapper

    from eric_epd.testing.sglang_cpu import unpinned_video_frames

    unpinned_video_frames()  # SGLang pins the frames unless its CPU engine (sgl_kernel) is on
    video, metadata = asyncio.run(preprocess_video(VideoDecoderWrapper(data, device="cpu")))
    return video.permute(0, 2, 3, 1).contiguous().numpy(), metadata


def qwen_vl_video_rows(model_dir: Path, frames: np.ndarray, text: str) -> tuple[torch.Tensor, list[int]]:
    """Transformers' rows and grid for `frames` through the checkpoint's own processor (no sampling: SGLang sampled)
    and its model's get_video_features (Qwen2-VL and Qwen2.5-VL), in float32."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    hf = AutoProcessor.from_pretrained(model_dir)
    inputs = hf(text=[text], videos=[frames], return_tensors="pt", do_sample_frames=False)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        feats = model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    rows = feats.pooler_output if hasattr(feats, "pooler_output") else feats
    rows = torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows
    return rows, inputs["video_grid_thw"][0].tolist()
