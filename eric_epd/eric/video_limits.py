"""Bounds on decoding a request's videos: each source's frame rate, count and duration, read from the container
before any frame is decoded; the request's decoded pixels and wall time; and its requester's presence."""

from __future__ import annotations

import threading
import time

from eric_epd.media.demux import open_input
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError


def count_frames(data: bytes, limit: int, demuxer: str) -> int:
    """The video packets in `data` (a container without a frame count in its header, opened with `demuxer`, the
    sniff's), counted up to limit + 1."""
    count = 0
    with open_input(data, demuxer) as container:
        for packet in container.demux(video=0):
            count += 1 if packet.size else 0
            if count > limit:
                break
    return count


def check_source(total: int, src_fps: float, limits: MediaLimits) -> None:
    """413 naming the flag when the source declares a higher frame rate, or holds more frames or seconds, than the
    limits allow."""
    if src_fps > limits.max_video_fps:
        raise MediaError(
            413,
            f"the video declares {src_fps:g} frames per second, over the limit of "
            f"{limits.max_video_fps:g} (--max-video-fps)",
        )
    if total > limits.max_video_source_frames:
        raise MediaError(
            413,
            f"the video holds {total} frames, over the limit of {limits.max_video_source_frames} "
            "(--max-video-source-frames)",
        )
    if total / src_fps > limits.max_video_seconds:
        raise MediaError(
            413,
            f"the video is {total / src_fps:.0f} s long, over the limit of "
            f"{limits.max_video_seconds:.0f} s (--max-video-seconds)",
        )


class VideoBudget:
    """One request's budget for decoding its videos, shared by the preprocessing threads: pixels (each video
    reserves its frames up to the last sampled one x its frame size before it decodes) and wall time (from the
    request's first decode); and its requester's presence."""

    def __init__(self, limits: MediaLimits, stop: threading.Event | None = None) -> None:
        self._max_pixels, self._max_s = limits.max_video_decode_pixels, limits.max_video_decode_s
        self._used = 0
        self._deadline: float | None = None
        self._lock = threading.Lock()
        self.stop = stop

    def reserve(self, frames: int, width: int, height: int) -> None:
        """Count a video that decodes `frames` frames of width x height; 413 if the request's videos would pass
        the pixel budget (nothing counted then)."""
        wanted = frames * width * height
        with self._lock:
            if self._used + wanted > self._max_pixels:
                raise MediaError(
                    413,
                    f"decoding the request's videos takes {self._used + wanted} pixels ({frames} "
                    f"frames of {width}x{height} for this one, up to its last sampled frame), over "
                    f"the limit of {self._max_pixels} (--max-video-decode-pixels)",
                )
            self._used += wanted

    def guard(self) -> DecodeGuard:
        """The check to run before each decoded frame; the request's clock starts at its first decode."""
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + self._max_s
            return DecodeGuard(self._deadline, self._max_s, self.stop)


class DecodeGuard:
    """Checked before each decoded frame: stops a decode that outlives its request's wall-time limit, or whose
    requester has gone (the request's stop event)."""

    def __init__(self, deadline: float, max_s: float, stop: threading.Event | None) -> None:
        self._deadline, self._max_s, self._stop = deadline, max_s, stop

    def check(self) -> None:
        """Raise `MediaError` if the requester has gone (499) or the decode ran past its time limit (413)."""
        if self._stop is not None and self._stop.is_set():
            raise MediaError(499, "the request was cancelled while its video was decoding")
        if time.monotonic() > self._deadline:
            raise MediaError(
                413, f"decoding the request's videos took over {self._max_s:g} s (--max-video-decode-seconds)"
            )
