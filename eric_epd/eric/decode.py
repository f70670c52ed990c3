"""Bounded image and video decoding for Eric's preprocessing; synchronous, meant for a thread pool."""

from __future__ import annotations

import io
import logging
import math
import threading
from collections.abc import Callable

import av
import numpy as np
from PIL import Image, UnidentifiedImageError

from eric_epd.eric.video_limits import VideoBudget, check_source, count_frames
from eric_epd.media.containers import IMAGE_FORMATS
from eric_epd.media.demux import open_for_decoding, sniff_for_decoding
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError

logger = logging.getLogger(__name__)


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Fully decode ``data`` to an RGB image (alpha composited on white, as vLLM does).

    400 for empty/corrupt/truncated input, 413 when width*height exceeds ``limits.max_image_pixels``
    (checked from the header, before pixels are allocated) or trips PIL's decompression-bomb guard.
    """
    if not data:
        raise MediaError(400, "image is empty (0 bytes)")
    try:
        Image.init()  # registers the plugins; a no-op after the first call
        formats = [name for name in IMAGE_FORMATS if name in Image.OPEN]  # AVIF is an optional build
        img = Image.open(io.BytesIO(data), formats=formats)
        width, height = img.size
        if width * height == 0:
            raise MediaError(400, f"image is empty ({width}x{height} pixels)")
        if width * height > limits.max_image_pixels:
            raise MediaError(
                413, f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_image_pixels}"
            )
        img.load()
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(413, f"image has too many pixels (decompression bomb guard): {exc}") from exc
    except UnidentifiedImageError as exc:
        raise MediaError(400, "could not decode image: unrecognised or unsupported format") from exc
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, struct.error... on bad input
        reason = str(exc) or type(exc).__name__
        if "truncated" in reason:
            raise MediaError(400, f"image is truncated: {reason}") from exc
        raise MediaError(400, f"could not decode image (corrupt data): {reason}") from exc
    if img.mode == "RGB":
        return img
    if img.mode == "RGBA":
        rgb = Image.new("RGB", img.size, (255, 255, 255))
        rgb.paste(img, mask=img.getchannel("A"))
        return rgb
    return img.convert("RGB")


def _frame_indices(total: int, src_fps: float, limits: MediaLimits) -> list[int]:
    """vLLM's uniform sampling: floor(duration * fps) frames (>= 2, <= max_video_frames) over [0, total)."""
    wanted = math.floor(total / src_fps * limits.video_fps)
    n = max(2, min(wanted, total, limits.max_video_frames))
    if n == total:
        return list(range(total))
    return np.linspace(0, total - 1, n, dtype=int).tolist()


def _check_frame_size(width: int, height: int, limits: MediaLimits) -> None:
    if width * height > limits.max_video_pixels:
        raise MediaError(
            413,
            f"video frames are {width}x{height} = {width * height} pixels, over the limit of {limits.max_video_pixels}",
        )


def decode_video(
    data: bytes,
    limits: MediaLimits,
    sampler: Callable[[int, float], list[int] | None] | None = None,
    stop: threading.Event | None = None,
    budget: VideoBudget | None = None,
) -> tuple[np.ndarray, float, tuple[float, ...]]:
    """Decode and sample ``data`` to RGB frames (T, H, W, 3) uint8; returns (frames, sampled_fps, seconds): the
    source time of each frame taken.

    sampled_fps is transformers' VideoMetadata.sampled_fps: frames taken / frames in the source * source fps.

    Frames are sampled uniformly at ``limits.video_fps`` (at least 2, at most ``max_video_frames``;
    a one-frame video yields that frame twice), unless ``sampler(total frames, source fps)`` names the frame
    indices (a model whose processor samples otherwise). 400 for undecodable input; 413 for oversize frames, for
    a source over the frame or duration limits (read from the container before decoding) and for a decode over its
    wall-time limit; decoding stops once `stop` is set (the requester has gone). `budget`: the request's, shared by
    its videos (pixels decoded, wall time; VideoBudget), else this video's own. The container must be one of
    `containers.VIDEO_DEMUXERS`, told from its leading bytes and forced on FFmpeg (400 otherwise: a playlist or a
    still image is never probed).
    """
    if not data:
        raise MediaError(400, "video is empty (0 bytes)")
    demuxer = sniff_for_decoding(data, "video")
    with open_for_decoding(data, demuxer, "video") as container:
        if not container.streams.video:
            raise MediaError(400, "could not decode video: no video stream")
        stream = container.streams.video[0]
        _check_frame_size(stream.codec_context.width, stream.codec_context.height, limits)
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        src_fps = float(rate) if rate else 0.0
        if not (src_fps > 0 and math.isfinite(src_fps)):
            raise MediaError(400, "could not decode video: unknown frame rate")
        try:
            total = stream.frames or count_frames(data, limits.max_video_source_frames, demuxer)
        except av.FFmpegError as exc:
            raise MediaError(400, f"could not decode video: {exc}") from exc
        if total <= 0:
            raise MediaError(400, "could not decode video: no frames")
        check_source(total, src_fps, limits)
        indices = (sampler(total, src_fps) if sampler is not None else None) or _frame_indices(total, src_fps, limits)
        if len(indices) > limits.max_video_frames:
            raise MediaError(
                413,
                f"the video is {total / src_fps:.1f} s long: this model samples {len(indices)} "
                f"frames from it, over the limit of {limits.max_video_frames} (--max-video-frames)",
            )
        indices = [min(max(i, 0), total - 1) for i in indices] or [0]
        if len(indices) < 2:
            indices = indices * 2
        wanted, last_wanted = set(indices), max(indices)
        budget = budget or VideoBudget(limits, stop)
        budget.reserve(last_wanted + 1, stream.codec_context.width, stream.codec_context.height)
        guard = budget.guard()
        stream.codec_context.thread_type = "AUTO"
        picked: dict[int, np.ndarray] = {}
        size: tuple[int, int] | None = None
        last = None
        try:
            for i, frame in enumerate(container.decode(stream)):
                guard.check()
                _check_frame_size(frame.width, frame.height, limits)
                size = size or (frame.width, frame.height)
                last = frame
                if i in wanted:
                    picked[i] = frame.to_ndarray(format="rgb24", width=size[0], height=size[1])
                if i >= last_wanted:
                    break
        except av.FFmpegError as exc:
            if last is None:
                raise MediaError(400, f"could not decode video: {exc}") from exc
            logger.warning("video decode stopped early: %s", exc)
    if last is None or size is None:
        raise MediaError(400, "could not decode video: no decodable frames")
    missing = [i for i in indices if i not in picked]
    if missing:  # the container promised more frames than it holds: pad with the last one
        logger.warning("video has fewer frames than its header says; padding %d samples", len(missing))
        fill = last.to_ndarray(format="rgb24", width=size[0], height=size[1])
        picked.update(dict.fromkeys(missing, fill))
    seconds = tuple(i / src_fps for i in indices)
    return np.stack([picked[i] for i in indices]), len(indices) / total * src_fps, seconds
