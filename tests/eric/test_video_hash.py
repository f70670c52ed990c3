"""A video's content hash covers its timing: the same frames at another frame rate are the same rows to the tower but
another video to an engine (Qwen3-VL writes each temporal step's time into the prompt, Qwen2.5-VL's positions follow
its seconds per grid step), and the engines key their caches by the hash the gateway sends as the item's uuid."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import av
import numpy as np

from eric_epd.eric.processor import PreparedItem, Processor
from eric_epd.media.limits import MediaLimits
from eric_epd.models.facts import ModelFacts
from eric_epd.models.registry import load_processor
from eric_epd.testing.media import video_frames


def _lossless_video(fps: int) -> bytes:
    """Four frames in FFV1 (lossless: at any frame rate they decode to the very same pixels) at `fps`."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "bgr0"
        for frame in video_frames(4, 64, 48, seed=3):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def test_the_same_frames_at_another_rate_hash_otherwise(qwen2_vl_tiny: Path) -> None:
    """The same four frames at 2 and at 1 frame per second: the same rows, other hashes; the same bytes again, the
    same hash."""
    facts = ModelFacts.from_checkpoint(qwen2_vl_tiny)
    processor = Processor(load_processor(facts.model_dir, facts.config), MediaLimits(), 1, b"model")
    try:
        fast, slow = _lossless_video(2), _lossless_video(1)
        got = asyncio.run(processor.prepare_many([("video", fast), ("video", slow), ("video", fast)]))
    finally:
        processor.close()
    assert all(isinstance(g, PreparedItem) for g in got), got
    first, other, again = got
    assert np.array_equal(first.item.pixel_values, other.item.pixel_values)  # the same frames sampled
    assert first.hash != other.hash
    assert again.hash == first.hash  # negative control: the hash is the content's, not a fresh one per request
