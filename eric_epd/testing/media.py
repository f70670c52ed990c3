"""Deterministic test media: images and short videos as bytes and data URLs (for tests, benchmarks, demos)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth random RGB image (gradients plus noise), deterministic by seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (3 + c) + y * (5 - c)) % 256 for c in range(3)], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")


def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    """The image encoded in `fmt` (PNG by default: lossless)."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """`data` as a base64 data URL of type `mime`."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_data_url(width: int, height: int, seed: int = 0) -> str:
    """A `random_image` of this size and seed as a PNG data URL."""
    return data_url(image_bytes(random_image(width, height, seed)))


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
