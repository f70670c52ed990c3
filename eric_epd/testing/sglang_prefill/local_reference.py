"""SGLang's own, non-disaggregated processing of a job in the prefill host: the local reference the EPD path's
placement is compared against (its audio loaded without the torchaudio this machine lacks)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

from eric_epd.testing.sglang_prefill.messages import Job, Outcome, pack


@contextlib.contextmanager
def _load_audio_without_torchaudio() -> Any:
    """SGLang's load_audio without torchcodec falls back to soundfile and imports torchaudio, which this machine
    lacks. `load_audio_stand_in` does that fallback's steps (soundfile.read, mean over channels) for clips already at
    the target rate, where the fallback never calls torchaudio; other rates are refused, not resampled."""
    import base64
    import io

    import numpy as np
    import soundfile
    from sglang.srt.multimodal.processors import base_processor

    def load_audio_stand_in(audio: Any, sr: int | None = None, mono: bool = True) -> np.ndarray:
        source = base64.b64decode(audio.split(",", 1)[1]) if audio.startswith("data:") else audio
        samples, rate = soundfile.read(io.BytesIO(source) if isinstance(source, bytes) else source)
        if rate != (sr or 16000):
            raise ValueError(f"load_audio_stand_in does not resample ({rate} Hz -> {sr} Hz)")
        return np.mean(samples, axis=1) if mono and samples.ndim > 1 else samples

    real, base_processor.load_audio = base_processor.load_audio, load_audio_stand_in
    try:
        yield
    finally:
        base_processor.load_audio = real


def local_outcome(job: Job, mm_processor: Any) -> Outcome:
    """SGLang's own, non-disaggregated processing of the job's images, videos and audio: its HF preprocessing and
    placement (for audio, each item's feature frames and its tower-side token counts)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    ref = GenerateReqInput(
        text=job.prompt, image_data=job.images or None, video_data=job.videos or None, audio_data=job.audios or None
    )
    media: dict[str, Any] = {"image_data": job.images or None}  # Qwen-VL reads videos and audio off `ref`
    if job.audios:  # Qwen2-Audio's processor takes them as an argument
        media["audio_data"] = job.audios
    with _load_audio_without_torchaudio():
        local_mm = asyncio.run(
            mm_processor.process_mm_data_async(input_text=job.prompt, request_obj=ref, max_req_input_len=4096, **media)
        )
    audio = [i.feature_attention_mask for i in local_mm.mm_items if i.is_audio()]
    grid = {
        name: torch.cat(grids).tolist()
        for name, grids in (
            ("img_grid_thw", [i.image_grid_thw for i in local_mm.mm_items if i.is_image()]),
            ("video_grid_thw", [i.video_grid_thw for i in local_mm.mm_items if i.is_video()]),
        )
        if grids
    }
    return Outcome(
        ok=True,
        input_ids=[int(x) for x in local_mm.input_ids],
        mrope=pack(local_mm.mrope_positions) if local_mm.mrope_positions is not None else None,
        grid=grid,
        audio_feature_lens=[int(x) for x in torch.cat(audio).sum(-1)] if audio else [],
    )
