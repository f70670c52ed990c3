"""Deterministic test media: images, short videos and audio clips as bytes and data URLs (for tests, benchmarks,
demos)."""

from __future__ import annotations

import io

import numpy as np

from eric_epd.media.synthetic import data_url, image_bytes, image_data_url, random_image

__all__ = [
    "AUDIO_FORMATS",
    "audio_bytes",
    "audio_samples",
    "data_url",
    "image_bytes",
    "image_data_url",
    "random_image",
    "video_bytes",
    "video_data_url",
    "video_frames",
    "video_with_audio_bytes",
]

AUDIO_FORMATS = {
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "flac": ("FLAC", "PCM_24", "audio/flac"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "ogg": ("OGG", "VORBIS", "audio/ogg"),
}
"""Name -> (libsndfile container, encoding, MIME type) of the audio formats the tests write."""


def video_frames(num_frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 (T, H, W, 3) frames that differ from one another."""
    return np.stack([np.asarray(random_image(width, height, seed * 1000 + i)) for i in range(num_frames)])


def video_bytes(num_frames: int = 8, width: int = 64, height: int = 48, fps: int = 4, seed: int = 0) -> bytes:
    """An MP4 (mpeg4 codec) of random frames; decoding is lossy, so compare decoded frames, not these."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in video_frames(num_frames, width, height, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def video_with_audio_bytes(
    num_frames: int = 8,
    width: int = 64,
    height: int = 48,
    fps: int = 4,
    rate: int = 16000,
    seed: int = 0,
    audio_seed: int | None = None,
    tone: float = 220.0,
) -> bytes:
    """An MP4 of `video_bytes`' frames (mpeg4) with a mono AAC soundtrack of `audio_samples` as long as the video
    (the encoder adds its priming and padding: compare decoded samples, not these); the soundtrack's samples from
    `audio_seed` where given (two videos, one soundtrack), else from `seed`, its tone at `tone` Hz."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=rate, layout="mono")
        for frame in video_frames(num_frames, width, height, seed):
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        samples = audio_samples(rate * num_frames // fps, rate, 1, seed if audio_seed is None else audio_seed, tone).T
        clip = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout="mono")
        clip.sample_rate = rate
        for stream, frame in ((video, None), (audio, clip), (audio, None)):
            for packet in stream.encode(frame):
                container.mux(packet)
    return buf.getvalue()


def video_data_url(num_frames: int = 8, width: int = 64, height: int = 48, fps: int = 4, seed: int = 0) -> str:
    """A `video_bytes` MP4 as a video/mp4 data URL."""
    return data_url(video_bytes(num_frames, width, height, fps, seed), "video/mp4")


def audio_samples(frames: int, rate: int, channels: int = 1, seed: int = 0, tone: float = 220.0) -> np.ndarray:
    """float32 [frames, channels] in [-0.5, 0.5]: a tone per channel (`tone` Hz, then 220 Hz apart) under quiet
    noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames)[:, None] / rate
    tones = 0.3 * np.sin(2 * np.pi * (tone + 220.0 * np.arange(channels))[None, :] * t)
    return (tones + 0.05 * rng.standard_normal((frames, channels))).astype(np.float32)


def audio_bytes(frames: int, rate: int, channels: int = 1, fmt: str = "wav", seed: int = 0) -> bytes:
    """`audio_samples` encoded as `fmt` (a key of AUDIO_FORMATS) by libsndfile; mp3 and ogg are lossy, so compare
    decoded samples, not these."""
    import soundfile

    container, subtype, _ = AUDIO_FORMATS[fmt]
    buf = io.BytesIO()
    soundfile.write(buf, audio_samples(frames, rate, channels, seed), rate, format=container, subtype=subtype)
    return buf.getvalue()
