"""Deterministic test media: images and short videos as bytes and data URLs (for tests, benchmarks, demos)."""

from __future__ import annotations

import io

import numpy as np

from eric_epd.media.synthetic import data_url, image_bytes, image_data_url, random_image

__all__ = ["data_url", "image_bytes", "image_data_url", "random_image", "video_bytes", "video_data_url",
           "video_frames"]


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


def video_data_url(num_frames: int = 8, width: int = 64, height: int = 48, fps: int = 4, seed: int = 0) -> str:
    """A `video_bytes` MP4 as a video/mp4 data URL."""
    return data_url(video_bytes(num_frames, width, height, fps, seed), "video/mp4")
