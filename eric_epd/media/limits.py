"""Per-item limits on fetching and decoding media, shared by Eric (fetch and decode) and the gateway (fetch)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_AUDIO_SAMPLE_RATE = 192_000
"""Highest audio sample rate (Hz) Eric takes: the resampler's ceiling, and so --max-audio-sample-rate's."""


@dataclass(frozen=True)
class MediaLimits:
    """Per-item resource limits for fetching and decoding media."""

    max_bytes: int = 64 * 2**20  # downloaded / decoded-from-base64 bytes per item
    timeout_s: float = 10.0  # whole fetch, redirects included
    max_redirects: int = 3
    max_image_pixels: int = 40_000_000  # width*height, checked from the header before decoding
    max_video_frames: int = 64  # frames sampled
    video_fps: float = 2.0  # sample rate
    max_video_pixels: int = 8_000_000  # per frame
    max_video_source_frames: int = 36_000  # frames in the source (decoding runs up to the last sampled one)
    max_video_seconds: float = 3600.0  # source duration
    max_video_decode_s: float = 30.0  # wall time to decode one request's videos
    max_video_fps: float = 240.0  # declared source frame rate, read before decoding
    max_video_decode_pixels: int = 16_000_000_000  # frames decoded (up to the last sampled) x frame size, per request
    max_audio_seconds: float = 600.0  # one audio item's duration (vLLM's VLLM_MAX_AUDIO_DECODE_DURATION_S default)
    max_audio_sample_rate: int = MAX_AUDIO_SAMPLE_RATE  # Hz, read from the header before decoding
    max_audio_channels: int = 8  # read from the header before decoding
    max_audio_decode_bytes: int = 256 * 2**20  # decoded float32 PCM (vLLM's VLLM_MAX_AUDIO_DECODE_BYTES default)

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_image_pixels, self.max_video_pixels) <= 0:
            raise ValueError("MediaLimits byte and pixel limits must be positive")
        if self.timeout_s <= 0 or self.video_fps <= 0 or self.max_redirects < 0:
            raise ValueError("MediaLimits timeout_s and video_fps must be > 0, max_redirects >= 0")
        if self.max_video_frames < 2:
            raise ValueError("MediaLimits.max_video_frames must be >= 2")
        if (
            min(
                self.max_video_source_frames,
                self.max_video_seconds,
                self.max_video_decode_s,
                self.max_video_fps,
                self.max_video_decode_pixels,
            )
            <= 0
        ):
            raise ValueError("MediaLimits video source frames, seconds, rate, decode time and pixels must be positive")
        if (
            min(
                self.max_audio_seconds, self.max_audio_sample_rate, self.max_audio_channels, self.max_audio_decode_bytes
            )
            <= 0
        ):
            raise ValueError("MediaLimits audio seconds, sample rate, channels and decode bytes must be positive")
        if self.max_audio_sample_rate > MAX_AUDIO_SAMPLE_RATE:  # else a clip decoded only for the resampler to refuse
            raise ValueError(
                f"MediaLimits.max_audio_sample_rate must be at most {MAX_AUDIO_SAMPLE_RATE} Hz, the "
                "highest rate the resampler takes"
            )
