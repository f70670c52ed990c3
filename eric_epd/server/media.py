"""Async media fetching (http(s)/data/file URLs under a ``UrlPolicy``) and bounded image/video decoding.

``fetch`` is async; ``decode_image`` and ``decode_video`` are synchronous and meant for a thread pool.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import math
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin

import av
import httpcore
import httpx
import numpy as np
from PIL import Image, UnidentifiedImageError

from eric_epd.server.url_policy import MediaError, UrlPolicy, display_url, url_scheme
from eric_epd.server.video_limits import DecodeGuard, check_source, count_frames

__all__ = ["MediaError", "MediaFetcher", "MediaLimits", "UrlPolicy", "decode_image", "decode_video"]

logger = logging.getLogger(__name__)

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Formats PIL may try; excludes e.g. EPS (runs Ghostscript) and exotic plugins.
_IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "PPM", "ICO", "AVIF")


@dataclass(frozen=True)
class MediaLimits:
    """Per-item resource limits for fetching and decoding media."""

    max_bytes: int = 64 * 2**20  # downloaded / decoded-from-base64 bytes per item
    timeout_s: float = 10.0  # whole fetch, redirects included
    max_redirects: int = 3
    max_image_pixels: int = 40_000_000  # width*height, checked from the header before decoding
    max_video_frames: int = 64  # frames sampled
    video_fps: float = 2.0  # sample rate
    max_video_pixels: int = 8_000_000  # per frame
    max_video_source_frames: int = 36_000  # frames in the source (decoding runs up to the last sampled one)
    max_video_seconds: float = 3600.0  # source duration
    max_video_decode_s: float = 30.0  # wall time to decode one video

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_image_pixels, self.max_video_pixels) <= 0:
            raise ValueError("MediaLimits byte and pixel limits must be positive")
        if self.timeout_s <= 0 or self.video_fps <= 0 or self.max_redirects < 0:
            raise ValueError("MediaLimits timeout_s and video_fps must be > 0, max_redirects >= 0")
        if self.max_video_frames < 2:
            raise ValueError("MediaLimits.max_video_frames must be >= 2")
        if min(self.max_video_source_frames, self.max_video_seconds, self.max_video_decode_s) <= 0:
            raise ValueError("MediaLimits video source frames, seconds and decode time must be positive")


class _PolicyNetworkBackend(httpcore.AsyncNetworkBackend):
    """Resolves each host itself and connects only to addresses the policy allows (no DNS rebinding)."""

    def __init__(self, policy: UrlPolicy) -> None:
        self._policy = policy
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addrs = await self._policy.resolve_host(host, port)
        for i, addr in enumerate(addrs):
            try:
                return await self._inner.connect_tcp(addr, port, timeout, local_address, socket_options)
            except httpcore.ConnectError:
                if i == len(addrs) - 1:
                    raise
        raise AssertionError("unreachable")  # resolve_host never returns an empty list

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise MediaError(400, "unix sockets are not allowed for media URLs")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _PolicyTransport(httpx.AsyncHTTPTransport):
    def __init__(self, policy: UrlPolicy) -> None:
        ssl_context = httpx.create_ssl_context(trust_env=False)
        super().__init__(verify=ssl_context, trust_env=False)
        # httpx has no DNS hook: swap in an httpcore pool whose backend vets every resolved address.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context, network_backend=_PolicyNetworkBackend(policy)
        )


class MediaFetcher:
    """Fetches media bytes for http(s), data and file URLs under a ``UrlPolicy`` and ``MediaLimits``."""

    def __init__(self, policy: UrlPolicy, limits: MediaLimits):
        self.policy = policy
        self.limits = limits
        self._client = httpx.AsyncClient(
            transport=_PolicyTransport(policy),
            follow_redirects=False,  # redirects are followed by hand so every hop is re-checked
            timeout=httpx.Timeout(limits.timeout_s),
            trust_env=False,
            headers={"User-Agent": "eric-epd-media/0.1"},
        )

    async def fetch(self, url: str) -> bytes:
        """The bytes behind ``url``; raises ``MediaError`` (4xx) naming the problem."""
        shown = display_url(url)
        try:
            return await asyncio.wait_for(self._fetch(url), self.limits.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            raise MediaError(408, f"timed out fetching {shown} (limit {self.limits.timeout_s:g} s)") from exc

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _fetch(self, url: str) -> bytes:
        self.policy.check(url)
        scheme = url_scheme(url)
        if scheme == "data":
            return _decode_data_url(url, self.limits.max_bytes)
        if scheme == "file":
            return await asyncio.to_thread(self._read_file, url)
        return await self._fetch_http(url)

    async def _fetch_http(self, url: str) -> bytes:
        for _hop in range(self.limits.max_redirects + 1):
            shown = display_url(url)
            try:
                result = await self._get(url)
            except (MediaError, httpx.TimeoutException):
                raise
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise MediaError(400, f"could not fetch {shown}: {_describe(exc)}") from exc
            if isinstance(result, bytes):
                return result
            url = result
            try:
                if url_scheme(url) not in ("http", "https"):
                    raise MediaError(400, f"unsupported URL scheme {url_scheme(url)!r} for a redirect")
                self.policy.check(url)
            except MediaError as exc:
                raise MediaError(exc.status, f"redirect from {shown} refused: {exc.message}") from exc
        raise MediaError(400, f"too many redirects (more than {self.limits.max_redirects})")

    async def _get(self, url: str) -> bytes | str:
        """One GET: the body, or the absolute redirect target."""
        shown, max_bytes = display_url(url), self.limits.max_bytes
        async with self._client.stream("GET", url) as resp:
            location = resp.headers.get("location")
            if resp.status_code in _REDIRECT_STATUSES and location:
                return urljoin(str(resp.url), location)
            if not resp.is_success:
                reason = f"{resp.status_code} {resp.reason_phrase}".strip()
                raise MediaError(400, f"could not fetch {shown}: origin returned HTTP {reason}")
            length = resp.headers.get("content-length", "")
            encoded = resp.headers.get("content-encoding", "identity") != "identity"
            if length.isdigit() and int(length) > max_bytes and not encoded:
                raise MediaError(413, f"{shown} is {length} bytes, over the limit of {max_bytes}")
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise MediaError(413, f"{shown} is over the size limit of {max_bytes} bytes")
            return bytes(body)

    def _read_file(self, url: str) -> bytes:
        path = self.policy.resolve_file(url)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:
            raise MediaError(404, f"file not found: {path}") from exc
        except PermissionError as exc:
            raise MediaError(403, f"permission denied reading {path}") from exc
        except OSError as exc:  # e.g. ELOOP: the path was swapped for a symlink after the check
            raise MediaError(403, f"cannot open {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MediaError(400, f"{path} is not a regular file")
            if st.st_size > self.limits.max_bytes:
                limit = self.limits.max_bytes
                raise MediaError(413, f"file is {st.st_size} bytes, over the limit of {limit}")
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read(self.limits.max_bytes + 1)
        if len(data) > self.limits.max_bytes:
            raise MediaError(413, f"file is over the size limit of {self.limits.max_bytes} bytes")
        return data


def _describe(exc: BaseException) -> str:
    """Short reason for a transport error, e.g. 'connection refused'."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused"
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    if "refused" in text.lower():
        return "connection refused"
    return text or type(exc).__name__


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    header, _, payload = url.partition(",")
    if header.lower().endswith(";base64"):
        if (len(payload) * 3) // 4 > max_bytes + 3:  # cheap upper bound before decoding anything
            raise MediaError(413, f"data URL payload is over the size limit of {max_bytes} bytes")
        text = "".join(payload.split())
        text += "=" * (-len(text) % 4)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(400, f"data URL has invalid base64 payload: {exc}") from exc
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(413, f"data URL payload is {len(data)} bytes, over the limit of {max_bytes}")
    return data


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Fully decode ``data`` to an RGB image (alpha composited on white, as vLLM does).

    400 for empty/corrupt/truncated input, 413 when width*height exceeds ``limits.max_image_pixels``
    (checked from the header, before pixels are allocated) or trips PIL's decompression-bomb guard.
    """
    if not data:
        raise MediaError(400, "image is empty (0 bytes)")
    try:
        Image.init()  # registers the plugins; a no-op after the first call
        formats = [name for name in _IMAGE_FORMATS if name in Image.OPEN]  # AVIF is an optional build
        img = Image.open(io.BytesIO(data), formats=formats)
        width, height = img.size
        if width * height == 0:
            raise MediaError(400, f"image is empty ({width}x{height} pixels)")
        if width * height > limits.max_image_pixels:
            raise MediaError(
                413,
                f"image is {width}x{height} = {width * height} pixels, "
                f"over the limit of {limits.max_image_pixels}",
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
            f"video frames are {width}x{height} = {width * height} pixels, "
            f"over the limit of {limits.max_video_pixels}",
        )


def decode_video(data: bytes, limits: MediaLimits,
                 sampler: Callable[[int, float], list[int] | None] | None = None,
                 stop: threading.Event | None = None) -> tuple[np.ndarray, float, tuple[float, ...]]:
    """Decode and sample ``data`` to RGB frames (T, H, W, 3) uint8; returns (frames, sampled_fps, seconds): the
    source time of each frame taken.

    sampled_fps is transformers' VideoMetadata.sampled_fps: frames taken / frames in the source * source fps.

    Frames are sampled uniformly at ``limits.video_fps`` (at least 2, at most ``max_video_frames``;
    a one-frame video yields that frame twice), unless ``sampler(total frames, source fps)`` names the frame
    indices (a model whose processor samples otherwise). 400 for undecodable input; 413 for oversize frames, for
    a source over the frame or duration limits (read from the container before decoding) and for a decode over its
    wall-time limit; decoding stops once `stop` is set (the requester has gone).
    """
    if not data:
        raise MediaError(400, "video is empty (0 bytes)")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.FFmpegError as exc:
        raise MediaError(400, f"could not decode video: {exc}") from exc
    except Exception as exc:
        raise MediaError(400, f"could not decode video: {str(exc) or type(exc).__name__}") from exc
    with container:
        if not container.streams.video:
            raise MediaError(400, "could not decode video: no video stream")
        fmt = container.format.name
        if fmt.endswith("_pipe") or fmt == "image2":  # ffmpeg opens a lone still image as a one-frame "video"
            raise MediaError(400, f"not a video: the data is a still image ({fmt}); send it as modality 'image'")
        stream = container.streams.video[0]
        _check_frame_size(stream.codec_context.width, stream.codec_context.height, limits)
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        src_fps = float(rate) if rate else 0.0
        if not (src_fps > 0 and math.isfinite(src_fps)):
            raise MediaError(400, "could not decode video: unknown frame rate")
        try:
            total = stream.frames or count_frames(data, limits.max_video_source_frames)
        except av.FFmpegError as exc:
            raise MediaError(400, f"could not decode video: {exc}") from exc
        if total <= 0:
            raise MediaError(400, "could not decode video: no frames")
        check_source(total, src_fps, limits.max_video_source_frames, limits.max_video_seconds)
        guard = DecodeGuard(limits.max_video_decode_s, stop)
        indices = (sampler(total, src_fps) if sampler is not None else None) or _frame_indices(total, src_fps, limits)
        if len(indices) > limits.max_video_frames:
            raise MediaError(413, f"the video is {total / src_fps:.1f} s long: this model samples {len(indices)} "
                                  f"frames from it, over the limit of {limits.max_video_frames} (--max-video-frames)")
        indices = [min(max(i, 0), total - 1) for i in indices] or [0]
        if len(indices) < 2:
            indices = indices * 2
        wanted, last_wanted = set(indices), indices[-1]
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
