"""Bounds on decoding one video: its source's frame count and duration, read from the container before any frame is
decoded, the decode's wall time, and its requester's presence."""

from __future__ import annotations

import threading
import time

from eric_epd.media.demux import open_input
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


def check_source(total: int, src_fps: float, max_frames: int, max_seconds: float) -> None:
    """413 naming the flag when the source holds more frames or seconds than the limits allow."""
    if total > max_frames:
        raise MediaError(413, f"the video holds {total} frames, over the limit of {max_frames} "
                              "(--max-video-source-frames)")
    if total / src_fps > max_seconds:
        raise MediaError(413, f"the video is {total / src_fps:.0f} s long, over the limit of {max_seconds:.0f} s "
                              "(--max-video-seconds)")


class DecodeGuard:
    """Checked before each decoded frame: stops a decode that outlives its wall-time limit, or whose requester has
    gone (the request's stop event)."""

    def __init__(self, max_s: float, stop: threading.Event | None) -> None:
        self._deadline, self._max_s, self._stop = time.monotonic() + max_s, max_s, stop

    def check(self) -> None:
        """Raise `MediaError` if the requester has gone (499) or the decode ran past its time limit (413)."""
        if self._stop is not None and self._stop.is_set():
            raise MediaError(499, "the request was cancelled while its video was decoding")
        if time.monotonic() > self._deadline:
            raise MediaError(413, f"decoding the video took over {self._max_s:g} s (--max-video-decode-seconds)")
