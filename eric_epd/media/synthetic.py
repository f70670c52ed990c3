"""Synthetic images as bytes and data URLs (deterministic by seed): load for the profiler and the benchmarks, and
the test kit's media."""

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
