"""What the gateway asks of a medium before an engine sees it: vLLM's own loaders open media with FFmpeg probing
(PyAV, OpenCV), so beyond `containers.sniff`'s allowlist no bytes FFmpeg's probes read may describe other streams.

FFmpeg takes a buffer for SDP (whose media lines it then opens as RTP sockets) where any line starts `c=IN IP`, up to
a line that starts with a NUL byte, even after a real container's magic; DASH and IMF manifests (which name other
files) where `<MPD` or `<CompositionPlaylist` comes before the first NUL byte. It probes at most PROBE_BYTES, from
the start and, where the data starts with an ID3v2 tag, from past it. So those bytes, from both places, must hold
none of PROBE_TEXT as FFmpeg's probes would read them (a lone `ffconcat` or `#EXTM3U` counts only at the start, where
the allowlist already refuses it)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from urllib.parse import unquote_to_bytes

from eric_epd.media.containers import SNIFF_BYTES, id3_length, sniff
from eric_epd.media.url_policy import MediaError

Reader = Callable[[int], bytes]
"""The first n bytes of a medium, fewer only where it ends."""

PROBE_BYTES = 1 << 20
"""The most FFmpeg's format probing reads (PROBE_BUF_MAX)."""
SDP_LINE = b"c=IN IP"
"""What a line starts with that SDP's probe takes (case as FFmpeg's `av_strstart`)."""
PROBE_TEXT = ((b"<mpd", "a DASH manifest"), (b"<compositionplaylist", "an IMF composition playlist"))
"""Text (lower-cased) by which FFmpeg's probes, reading up to the first NUL byte, take a buffer for a manifest."""
PLAYLISTS = ((b"ffconcat", "an ffconcat playlist"), (b"#extm3u", "an HLS (m3u8) playlist"))
"""Text (lower-cased) by which FFmpeg's probes take a buffer that starts with it for a playlist."""


def check_for_engine(read: Reader, modality: str) -> str:
    """`sniff`'s demuxer or format for the medium `read` gives; 400 naming the problem when it is not in the
    modality's allowlist or, for audio and video, holds text FFmpeg's probing would follow (module docstring)."""
    head = read(SNIFF_BYTES)
    skip = id3_length(head)
    name = sniff(read(skip + SNIFF_BYTES) if skip else head, modality)
    if modality != "image":  # images reach PIL only (vLLM passes its own format allowlist), never FFmpeg
        for start in sorted({0, skip}):
            label = _probed_as(_probe_window(read, start))
            if label is not None:
                raise MediaError(
                    400,
                    f"not a supported {modality}: a probing decoder would take it for {label}; send the medium itself",
                )
    return name


def _probed_as(window: bytes) -> str | None:
    """What FFmpeg's text probes would take `window` for, None if nothing."""
    if _has_sdp_line(window, _sdp_end(window)):
        return "an SDP session description (a line 'c=IN IP...')"
    text = window.partition(b"\0")[0].lower()
    for needle, label in PLAYLISTS:
        if text.startswith(needle):
            return label
    for needle, label in PROBE_TEXT:
        if needle in text:
            return label
    return None


def _sdp_end(window: bytes) -> int:
    """Where SDP's probe stops reading lines: the first that starts with a NUL byte (after `\\n` or `\\n\\r`);
    len(window) if none does."""
    if window[:1] == b"\0":
        return 0
    ends = [at for at in (window.find(b"\n\0"), window.find(b"\n\r\0")) if at >= 0]
    return min(ends) if ends else len(window)


def _has_sdp_line(window: bytes, end: int) -> bool:
    """Whether a line before `end` starts with SDP_LINE (at the start, after `\\n` or after `\\n\\r`)."""
    at = window.find(SDP_LINE, 0, end)
    while at >= 0:
        if at == 0 or window[at - 1] == 0x0A or (at >= 2 and window[at - 2 : at] == b"\n\r"):
            return True
        at = window.find(SDP_LINE, at + 1, end)
    return False


def _probe_window(read: Reader, start: int) -> bytes:
    """The bytes FFmpeg's text probes would read from `start`: read on until SDP's probe would stop (a line starting
    with a NUL byte), the data ends or PROBE_BYTES."""
    size = SNIFF_BYTES
    while True:
        window = read(start + size)[start:]
        if _sdp_end(window) < len(window) or len(window) < size or size >= PROBE_BYTES:
            return window[:PROBE_BYTES]
        size *= 4


def bytes_reader(data: bytes) -> Reader:
    """A `Reader` of bytes at hand."""
    return lambda size: data[:size]


def data_url_reader(url: str) -> Reader:
    """A `Reader` of a data: URL's payload that decodes only as much as it is asked for; 400 for a URL without a
    payload or for base64 that does not decode."""
    comma = url.find(",")
    if comma < 0:
        raise MediaError(400, "malformed data URL: no ',' before the payload")
    start = comma + 1
    if not url[:comma].lower().endswith(";base64"):
        return lambda size: unquote_to_bytes(url[start : start + 3 * size])[:size]  # 1 to 3 characters a byte
    return lambda size: _base64_head(url, start, size)


def _base64_head(url: str, start: int, size: int) -> bytes:
    """The first `size` bytes of the base64 payload from url[start:], whitespace inside it skipped."""
    want = (size + 2) // 3 * 4
    end = start + want
    text = "".join(url[start:end].split())
    while len(text) < want and end < len(url):  # whitespace took room: read on until `want` characters or the end
        more = want - len(text)
        text += "".join(url[end : end + more].split())
        end += more
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)[:size]
    except (binascii.Error, ValueError) as exc:
        raise MediaError(400, f"data URL has invalid base64 payload: {exc}") from exc
