"""Video decoding is bounded: a source over the frame or duration limit is refused with a 413 naming the flag before
any frame is decoded, a decode over its wall-time limit is refused, a decode stops once its requester has gone, and a
served Eric refuses a small file holding a huge frame count while good requests beside it are answered."""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from eric_epd.eric.decode import decode_video
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import data_url, video_bytes


def _still_video(frames: int, fps: int, size: int = 16) -> bytes:
    """An MP4 of `frames` identical tiny frames: a few bytes each, so a huge frame count in a small file."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"g": "100000"}  # one key frame: the rest are empty predictions
        frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 90, np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _refused(data: bytes, limits: MediaLimits, named: str, stop: threading.Event | None = None) -> int:
    with pytest.raises(MediaError) as caught:
        decode_video(data, limits, stop=stop)
    assert named in caught.value.message, caught.value.message
    return caught.value.status


def test_source_over_the_frame_or_duration_limit_is_refused_before_decoding() -> None:
    data = video_bytes(50, 32, 32, fps=25)  # 2 s
    assert _refused(data, MediaLimits(max_video_source_frames=40), "--max-video-source-frames") == 413
    assert _refused(data, MediaLimits(max_video_seconds=1.5), "--max-video-seconds") == 413
    frames, _, _ = decode_video(data, MediaLimits(max_video_source_frames=50, max_video_seconds=2.0))
    assert frames.shape[1:] == (32, 32, 3)


def test_decode_stops_at_its_wall_time_limit_and_when_the_requester_goes() -> None:
    data = video_bytes(8, 32, 32, fps=4)
    assert _refused(data, MediaLimits(max_video_decode_s=1e-9), "--max-video-decode-seconds") == 413
    gone = threading.Event()
    gone.set()
    assert _refused(data, MediaLimits(), "cancelled", stop=gone) == 499
    with pytest.raises(ValueError, match="positive"):
        MediaLimits(max_video_seconds=0)


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    with EricServer(qwen2_vl_tiny, log_path=tmp_path_factory.mktemp("video-limits") / "eric.log") as server:
        yield server


def _encode(eric: EricServer, data: bytes) -> httpx.Response:
    body = {"items": [{"modality": "video", "url": data_url(data, "video/mp4")}]}
    return httpx.post(eric.url + "/v1/encode", headers=eric.headers, json=body, timeout=120)


def test_huge_frame_count_is_refused_while_good_videos_beside_it_are_answered(eric: EricServer) -> None:
    bomb = _still_video(40_000, fps=1000)  # 40 s at 1000 fps: over the default 36,000 source frames
    assert len(bomb) < 1 << 20
    good = [video_bytes(8, 48, 32, fps=4, seed=s) for s in range(4)]
    with ThreadPoolExecutor(5) as pool:
        refused = pool.submit(_encode, eric, bomb)
        answers = list(pool.map(lambda d: _encode(eric, d), good))
        response = refused.result()
    # the frame count is read from the container before decoding (a decode would have stopped at its time limit)
    assert response.status_code == 413, response.text
    assert "40000 frames" in response.text and "--max-video-source-frames" in response.text
    assert [a.status_code for a in answers] == [200] * 4
    assert httpx.get(eric.url + "/health").status_code == 200
