"""Eric's copy of SGLang's video preparation (eric_epd/eric/sglang/video.py) against SGLang 0.5.23's own functions:
frame counts, target sizes and the frames themselves, under SGLang's defaults and under a --mm-process-config."""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import pytest

from eric_epd.eric.cli import _sglang_video
from eric_epd.eric.decode import decode_video
from eric_epd.eric.sglang.video import SglangVideo
from eric_epd.media.limits import MediaLimits
from eric_epd.testing.media import video_bytes
from tests.support.sglang_video import sglang_prepared_frames

CONFIGS = [{}, {"fps": 1.0, "min_pixels": 3136, "max_frames": 6}, {"nframes": 4, "max_pixels": 200_000}]


@pytest.mark.parametrize("config", CONFIGS, ids=["defaults", "fps-pixels", "nframes"])
def test_frame_counts_and_sizes_are_sglangs(config: dict) -> None:
    from sglang.srt.multimodal.processors import qwen_vl

    ours = SglangVideo.from_config(config)
    for total, fps in itertools.product((4, 8, 31, 300, 2000), (1.0, 4.0, 29.97, 60.0)):
        try:
            want = qwen_vl.smart_nframes(config, total_frames=total, video_fps=fps)
        except ValueError:
            with pytest.raises(ValueError):
                ours.frame_indices(total, fps)
            continue
        indices = ours.frame_indices(total, fps)
        assert indices == np.unique(np.linspace(0, total - 1, num=want, dtype=np.int64)).tolist(), (total, fps)
    for (h, w), frames in itertools.product(((48, 64), (720, 1280), (30, 2000), (1080, 1920)), (2, 4, 64)):
        min_pixels = config.get("min_pixels", qwen_vl.VIDEO_MIN_PIXELS)
        max_pixels = max(
            min(config.get("max_pixels", qwen_vl.VIDEO_MAX_PIXELS), qwen_vl.VIDEO_TOTAL_PIXELS / frames * 2),
            int(min_pixels * 1.05),
        )
        want = qwen_vl.smart_resize(h, w, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
        assert ours.target_size(h, w, frames) == want, (h, w, frames)
    # negative control: another setting gives other counts or sizes somewhere on the same grid
    other = SglangVideo.from_config({"fps": 3.0, "min_pixels": 6272} if config.get("fps") != 3.0 else {})
    assert other.frame_indices(300, 30.0) != ours.frame_indices(300, 30.0) or other.target_size(48, 64, 4) != (
        ours.target_size(48, 64, 4)
    )


def test_frames_are_the_ones_sglang_hands_its_processor() -> None:
    """Decoded by Eric (PyAV) at SGLang's frame indices and resized by SglangVideo: SGLang's own preprocess_video
    frames (decord, torchvision), exactly; another video's are not."""
    data = video_bytes(num_frames=12, width=80, height=60, fps=6, seed=21)
    like = SglangVideo()
    frames, _, seconds = decode_video(data, MediaLimits(), like.frame_indices)
    ours = like.resize(frames)
    want, metadata = sglang_prepared_frames(data)
    assert ours.shape == want.shape and np.array_equal(ours, want)
    assert list(metadata["frames_indices"]) == [round(s * 6) for s in seconds]
    other, _ = sglang_prepared_frames(video_bytes(num_frames=12, width=80, height=60, fps=6, seed=22))
    assert not np.array_equal(ours, other)


def test_the_flag_takes_sglangs_json_and_refuses_what_sglang_would() -> None:
    assert _sglang_video('{"video": {"fps": 1, "min_pixels": 3136}}') == SglangVideo(fps=1, min_pixels=3136)
    assert _sglang_video("{}") == SglangVideo()
    for bad in ('{"video": {"fps": 1, "nframes": 4}}', '{"video": {"fsp": 1}}', "[1]", "{"):
        with pytest.raises(argparse.ArgumentTypeError):
            _sglang_video(bad)
