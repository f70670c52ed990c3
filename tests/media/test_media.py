"""Media fetching (eric_epd.media) and decoding (eric_epd.eric.decode): a real local HTTP server, real files,
real PNG/JPEG/MP4 bytes."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from eric_epd.eric.decode import decode_image, decode_video
from eric_epd.media.fetch import MediaFetcher
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError, UrlPolicy

LOCAL = frozenset({"127.0.0.1"})
SMALL = MediaLimits(max_bytes=1 << 20, timeout_s=1.0, max_redirects=3)


def _image_bytes(fmt: str, size: tuple[int, int] = (16, 12), color: tuple[int, ...] = (200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGBA" if len(color) == 4 else "RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


PNG = _image_bytes("PNG")
JPEG = _image_bytes("JPEG")


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path
        port = self.server.server_address[1]
        if path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif path == "/img.jpg":
            self._send(200, JPEG, {"Content-Type": "image/jpeg"})
        elif path.startswith("/redirect/"):
            n = int(path.rsplit("/", 1)[1])
            self._send(302, headers={"Location": f"/redirect/{n - 1}" if n > 0 else "/img.png"})
        elif path == "/set-cookie":
            self._send(200, PNG, {"Set-Cookie": "session=secret; Path=/"})
        elif path == "/echo-cookie":
            self._send(200, (self.headers.get("Cookie") or "none").encode())
        elif path == "/redirect-file":
            self._send(302, headers={"Location": "file:///etc/passwd"})
        elif path == "/redirect-private":
            self._send(302, headers={"Location": f"http://[::1]:{port}/img.png"})
        elif path == "/big":
            self._send(200, b"x" * (2 << 20))
        elif path == "/big-unsized":  # no Content-Length: size only known while streaming
            self.send_response(200)
            self.end_headers()
            for _ in range(32):
                self.wfile.write(b"y" * 65536)
        elif path == "/slow":
            time.sleep(3)
            self._send(200, PNG)
        elif path == "/trickle":  # each read is quick, the whole body is not
            self.send_response(200)
            self.send_header("Content-Length", "40")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"z")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(404, b"not here")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: object, client_address: object) -> None:
        """A fetch refused mid-body resets its connection: expected here, not a traceback to print."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _fetch(url: str, policy: UrlPolicy | None = None, limits: MediaLimits = SMALL) -> bytes:
    async def go() -> bytes:
        fetcher = MediaFetcher(policy or UrlPolicy(host_allowlist=LOCAL), limits)
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.aclose()

    return asyncio.run(go())


def _error(fn: Callable[[], object]) -> MediaError:
    with pytest.raises(MediaError) as info:
        fn()
    return info.value


# ---------------------------------------------------------------- http(s)


def test_fetch_png_and_jpeg(base_url: str) -> None:
    assert _fetch(f"{base_url}/img.png") == PNG
    img = decode_image(_fetch(f"{base_url}/img.jpg"), SMALL)
    assert img.mode == "RGB" and img.size == (16, 12)
    assert np.abs(np.asarray(img).astype(int) - [200, 30, 40]).max() < 8


def test_redirects_within_and_over_limit(base_url: str) -> None:
    assert _fetch(f"{base_url}/redirect/2") == PNG  # 3 redirects, limit 3
    err = _error(lambda: _fetch(f"{base_url}/redirect/3"))
    assert err.status == 400 and "too many redirects" in err.message


def test_each_redirect_hop_is_rechecked(base_url: str) -> None:
    err = _error(lambda: _fetch(f"{base_url}/redirect-file"))
    assert err.status == 400 and "redirect" in err.message and "'file'" in err.message
    err = _error(lambda: _fetch(f"{base_url}/redirect-private"))
    assert err.status == 400 and "::1" in err.message and "private" in err.message


def test_body_over_max_bytes(base_url: str) -> None:
    for path in ("/big", "/big-unsized"):
        err = _error(lambda path=path: _fetch(base_url + path))
        assert err.status == 413 and "limit" in err.message


def test_timeouts(base_url: str) -> None:
    for path in ("/slow", "/trickle"):
        start = time.monotonic()
        err = _error(lambda path=path: _fetch(base_url + path))
        assert err.status == 408 and "timed out" in err.message
        assert time.monotonic() - start < 2.5


def test_origin_error_status(base_url: str) -> None:
    err = _error(lambda: _fetch(f"{base_url}/missing"))
    assert err.status == 400 and "404" in err.message and "/missing" in err.message


def test_unreachable_host() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.png"
    err = _error(lambda: _fetch(url))
    assert err.status == 400 and err.message == f"could not fetch {url}: connection refused"


def test_one_origins_cookies_never_go_out_again(base_url: str) -> None:
    """A cookie an origin set while one client's media was fetched is not sent on the next fetch (another client's,
    through the same fetcher); negative control: aiohttp's default client, which keeps cookies, sends it. By name
    (localhost): a cookie jar keeps no cookie for an IP address."""
    import aiohttp

    named = base_url.replace("127.0.0.1", "localhost")

    async def ours() -> bytes:
        fetcher = MediaFetcher(UrlPolicy(host_allowlist=frozenset({"localhost"})), SMALL)
        try:
            assert await fetcher.fetch(f"{named}/set-cookie") == PNG
            return await fetcher.fetch(f"{named}/echo-cookie")
        finally:
            await fetcher.aclose()

    async def keeping() -> bytes:
        async with aiohttp.ClientSession() as session:
            (await session.get(f"{named}/set-cookie")).release()
            async with session.get(f"{named}/echo-cookie") as resp:
                return await resp.read()

    assert asyncio.run(ours()) == b"none"
    assert asyncio.run(keeping()) == b"session=secret"


def test_private_hosts(base_url: str) -> None:
    port = base_url.rsplit(":", 1)[1]
    url = f"{base_url}/img.png"
    err = _error(lambda: _fetch(url, UrlPolicy()))
    assert err.status == 400 and "127.0.0.1" in err.message and "private" in err.message
    # a name resolving to loopback is refused after DNS resolution
    err = _error(lambda: _fetch(f"http://localhost:{port}/img.png", UrlPolicy()))
    assert err.status == 400 and "localhost" in err.message and "private" in err.message
    assert "127.0.0.1" not in err.message  # what the name resolves to stays in the log, not with the client
    assert _fetch(url, UrlPolicy(host_allowlist=frozenset({"127.0.0.1"}))) == PNG
    by_name = UrlPolicy(host_allowlist=frozenset({"LOCALHOST"}))
    assert _fetch(f"http://localhost:{port}/img.png", by_name) == PNG
    assert _fetch(url, UrlPolicy(allow_private_hosts=True)) == PNG


def test_unsupported_and_malformed_urls() -> None:
    err = _error(lambda: _fetch("ftp://example.com/a.png"))
    assert err.status == 400 and "unsupported URL scheme 'ftp'" in err.message
    err = _error(lambda: _fetch("https://example.com/a.png", UrlPolicy(allowed_schemes=frozenset({"data"}))))
    assert err.status == 400 and "'https'" in err.message
    assert _error(lambda: _fetch("no-scheme.png")).status == 400
    assert "before its host" in _error(lambda: _fetch("http:///a.png")).message
    assert _error(lambda: _fetch("http://127.0.0.1:99999/a")).status == 400


# ---------------------------------------------------------------- data: and file:


def test_data_urls() -> None:
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert _fetch(url) == PNG
    assert _fetch(url.rstrip("=")) == PNG  # missing padding tolerated
    assert _fetch("data:text/plain,hello%20world") == b"hello world"
    err = _error(lambda: _fetch("data:image/png;base64,!!notbase64!!"))
    assert err.status == 400 and "base64" in err.message
    big = "data:image/png;base64," + base64.b64encode(b"\0" * (SMALL.max_bytes + 10)).decode()
    err = _error(lambda: _fetch(big))
    assert err.status == 413 and "data URL" in err.message and len(err.message) < 200
    assert _error(lambda: _fetch("data:image/png;base64")).status == 400


def test_file_urls(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "a b.png").write_bytes(PNG)
    (root / "empty.png").write_bytes(b"")
    (outside / "secret.png").write_bytes(PNG)
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "big.bin").write_bytes(b"\0" * (SMALL.max_bytes + 1))
    policy = UrlPolicy(file_roots=(root,))

    assert _fetch(f"file://{root}/a%20b.png", policy) == PNG
    assert _fetch(f"file://localhost{root}/a%20b.png", policy) == PNG
    err = _error(lambda: _fetch(f"file://{outside}/secret.png", policy))
    assert err.status == 403 and "outside the allowed file roots" in err.message
    err = _error(lambda: _fetch(f"file://{root}/../outside/secret.png", policy))
    assert err.status == 403
    err = _error(lambda: _fetch(f"file://{root}/escape.png", policy))  # symlink pointing out of the root
    assert err.status == 403 and "escape.png" in err.message
    err = _error(lambda: _fetch(f"file://{root}/nope.png", policy))
    assert err.status == 404 and "nope.png" in err.message
    err = _error(lambda: _fetch(f"file://{root}/a%20b.png", UrlPolicy()))
    assert err.status == 403 and "disabled" in err.message
    assert _error(lambda: _fetch(f"file://{root}", policy)).status == 400  # a directory
    assert _error(lambda: _fetch(f"file://{root}/big.bin", policy)).status == 413
    assert _error(lambda: _fetch(f"file://otherhost{root}/a%20b.png", policy)).status == 400
    # a 0-byte file fetches fine and is refused at decode time
    err = _error(lambda: decode_image(_fetch(f"file://{root}/empty.png", policy), SMALL))
    assert err.status == 400 and "image is empty" in err.message


# ---------------------------------------------------------------- images


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG claiming width x height with a tiny IDAT: no pixels are ever allocated here."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + payload))
        return struct.pack(">I", len(payload)) + kind + payload + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_decode_png_rgba_composited_on_white() -> None:
    img = decode_image(_image_bytes("PNG", (4, 4), (255, 0, 0, 0)), SMALL)
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 255, 255)
    assert decode_image(PNG, SMALL).getpixel((3, 3)) == (200, 30, 40)
    assert decode_image(_image_bytes("GIF"), SMALL).mode == "RGB"


def test_decode_bad_images() -> None:
    err = _error(lambda: decode_image(b"", SMALL))
    assert err.status == 400 and "image is empty" in err.message
    err = _error(lambda: decode_image(b"definitely not an image" * 10, SMALL))
    assert err.status == 400 and "could not decode image" in err.message
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    noisy.save(buf, format="PNG")
    err = _error(lambda: decode_image(buf.getvalue()[: len(buf.getvalue()) // 2], SMALL))
    assert err.status == 400 and "truncated" in err.message
    corrupt = bytearray(JPEG)
    corrupt[len(corrupt) // 2 :] = b"\xff" * (len(corrupt) - len(corrupt) // 2)
    assert _error(lambda: decode_image(bytes(corrupt), SMALL)).status == 400


def test_decompression_bombs_refused_fast() -> None:
    start = time.monotonic()
    err = _error(lambda: decode_image(_png_header_only(50_000, 50_000), MediaLimits()))
    assert err.status == 413 and "pixels" in err.message
    # under PIL's own guard (89M) but over ours (40M): our header check fires
    err = _error(lambda: decode_image(_png_header_only(8_000, 8_000), MediaLimits()))
    assert err.status == 413 and "8000x8000" in err.message
    # a bomb that passes a lax limit still trips PIL's guard, mapped to 413
    lax = MediaLimits(max_image_pixels=10**10)
    assert _error(lambda: decode_image(_png_header_only(50_000, 50_000), lax)).status == 413
    assert time.monotonic() - start < 0.5
    assert _error(lambda: decode_image(_png_header_only(0, 5), SMALL)).status == 400


# ---------------------------------------------------------------- video

COLORS = [((i * 53) % 256, (i * 101 + 60) % 256, (i * 197 + 120) % 256) for i in range(20)]


def _make_video(n_frames: int = 20, fps: int = 10, size: int = 32, fmt: str = "mp4") -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=fps, options={"qp": "0", "preset": "ultrafast"})
        stream.width = stream.height = size
        stream.pix_fmt = "yuv444p"
        for i in range(n_frames):
            rgb = np.full((size, size, 3), COLORS[i % len(COLORS)], dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _which_frames(frames: np.ndarray) -> list[int]:
    means = frames.reshape(len(frames), -1, 3).mean(axis=1)
    dists = np.abs(means[:, None, :] - np.asarray(COLORS, dtype=float)[None]).max(axis=2)
    assert dists.min(axis=1).max() < 6  # every sampled frame is clearly one of the palette colours
    return dists.argmin(axis=1).tolist()


def test_decode_video_samples_at_fps() -> None:
    frames, sampled_fps, _ = decode_video(_make_video(), MediaLimits(video_fps=2.0))
    assert sampled_fps == pytest.approx(2.0)  # 4 of the 20 frames of a 10 fps video
    assert frames.dtype == np.uint8 and frames.shape == (4, 32, 32, 3)  # 2 s at 2 fps
    assert _which_frames(frames) == [0, 6, 12, 19]  # uniform over the 20 frames, vLLM's indexing


def test_decode_video_without_frame_count_in_header() -> None:
    data = _make_video(fmt="matroska")
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].frames == 0  # frames get counted by demuxing instead
    frames, sampled_fps, _ = decode_video(data, MediaLimits(video_fps=2.0))
    assert sampled_fps == pytest.approx(2.0) and _which_frames(frames) == [0, 6, 12, 19]


def test_decode_video_frame_cap_and_minimum() -> None:
    frames, sampled_fps, _ = decode_video(_make_video(), MediaLimits(video_fps=10.0, max_video_frames=8))
    assert _which_frames(frames) == [0, 2, 5, 8, 10, 13, 16, 19]
    assert sampled_fps == pytest.approx(4.0)  # capped at 8 frames: not the 10 fps asked for
    frames, _, _ = decode_video(_make_video(n_frames=2), MediaLimits(video_fps=0.5))
    assert _which_frames(frames) == [0, 1]  # at least 2 frames even when fps asks for fewer
    frames, _, _ = decode_video(_make_video(n_frames=1), MediaLimits())
    assert _which_frames(frames) == [0, 0]


def test_decode_video_errors() -> None:
    data = _make_video(n_frames=4)
    err = _error(lambda: decode_video(data, MediaLimits(max_video_pixels=32 * 32 - 1)))
    assert err.status == 413 and "32x32" in err.message
    err = _error(lambda: decode_video(b"this is not a video at all" * 20, MediaLimits()))
    assert err.status == 400 and "could not decode video" in err.message
    err = _error(lambda: decode_video(b"", MediaLimits()))
    assert err.status == 400 and "empty" in err.message
    assert _error(lambda: decode_video(data[: len(data) // 3], MediaLimits())).status == 400


def test_limits_validation() -> None:
    with pytest.raises(ValueError):
        MediaLimits(max_video_frames=1)
    with pytest.raises(ValueError):
        MediaLimits(video_fps=0)
