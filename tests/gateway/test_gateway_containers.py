"""The gateway gives an engine no medium a probing FFmpeg would follow (vLLM's own loaders probe): each data: URL and
`input_audio` part in the body and each medium it fetches must be a container of its part's modality's allowlist
(media/containers.py) with no SDP line or manifest in the bytes FFmpeg's probes read (media/engine_probe.py); else a
400 naming the part, before any upstream is called. Each trick is first shown to fool a probing `av.open` here."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import av
import pytest
from epd_gateway.app import create_app
from epd_gateway.config import GatewayConfig
from epd_gateway.content import collect_media
from epd_gateway.inline import MediaInliner
from starlette.testclient import TestClient

from eric_epd.common.errors import ApiError
from eric_epd.media.engine_probe import bytes_reader, check_for_engine, data_url_reader
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError, UrlPolicy
from eric_epd.testing.media import audio_bytes, data_url, image_bytes, random_image, video_bytes

CONCAT = b"ffconcat version 1.0\nfile secret.wav\n"
SDP = b"\r\nv=0\r\nc=IN IP4 127.0.0.1\r\n"
"""SDP without media lines: FFmpeg takes it for SDP but opens no socket."""
MP3_SYNC = b"\xff\xfb\x90\x64"
ID3 = b"ID3\x04\x00\x00\x00\x00\x00\x04abcd"
"""An ID3v2 tag of 4 bytes: FFmpeg's probe starts past it."""
WAV = audio_bytes(4000, 16000)
PNG = image_bytes(random_image(8, 8))


def _probed(data: bytes) -> str | None:
    """The demuxer a probing `av.open` (vLLM's) picks for `data`; None where it opens none."""
    try:
        with av.open(io.BytesIO(data)) as container:
            return container.format.name
    except av.FFmpegError:
        return None


def _refused(read: bytes, modality: str, *says: str) -> None:
    with pytest.raises(MediaError) as caught:
        check_for_engine(bytes_reader(read), modality)
    assert caught.value.status == 400
    for text in says:
        assert text in caught.value.message, caught.value.message


def test_sdp_behind_real_magic_is_refused() -> None:
    """The allowlist alone passes MP3's frame sync, yet FFmpeg probes what follows as SDP: deep in the buffer, past
    a NUL byte inside a line, past an ID3 tag. A line that starts with NUL ends what SDP's probe reads."""
    for data in (
        MP3_SYNC + SDP,
        MP3_SYNC + b"x" * 100_000 + SDP,
        MP3_SYNC + b"\x00" + SDP,
        ID3 + MP3_SYNC + SDP,
        b"\xff\xf1\x50\x80" + SDP,
        b"\x1a\x45\xdf\xa3" + SDP,
        b"OggS" + SDP,
    ):
        assert _probed(data) == "sdp"
        _refused(data, "audio", "SDP session description")
    _refused(b"\x1a\x45\xdf\xa3" + SDP, "video", "SDP session description")
    hidden = MP3_SYNC + b"\n\x00" + SDP  # SDP's probe stops at the line that starts with NUL
    assert _probed(hidden) != "sdp"
    assert check_for_engine(bytes_reader(hidden), "audio") == "mp3"
    _refused(ID3 + CONCAT, "audio", "not a supported audio container")  # after an ID3 tag: audio frames only
    _refused(MP3_SYNC + b"<MPD dash:profile:isoff-live:2011>", "audio", "a DASH manifest")


def test_what_the_project_sends_passes() -> None:
    for fmt in ("wav", "flac", "mp3", "ogg"):
        assert check_for_engine(bytes_reader(audio_bytes(8000, 16000, 2, fmt)), "audio") == fmt
    assert check_for_engine(bytes_reader(video_bytes()), "video") == "mov"
    assert check_for_engine(bytes_reader(video_bytes()), "audio") == "mov"  # an m4a, or a video's soundtrack
    assert check_for_engine(bytes_reader(PNG), "image") == "PNG"


def test_a_data_url_is_read_only_as_far_as_asked() -> None:
    payload = bytes(range(256)) * 40
    b64 = base64.b64encode(payload).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    spaced = b64[:100] + " " * 50_000 + b64[100:]  # blanks do not shorten what is read
    for url in (f"data:x;base64,{b64}", f"data:x;base64,{wrapped}", f"data:x;base64,{spaced}"):
        read = data_url_reader(url)
        assert read(10) == payload[:10] and read(4097) == payload[:4097] and read(1 << 20) == payload
    assert data_url_reader("data:text/plain,a%00b")(2) == b"a\x00"
    with pytest.raises(MediaError, match="invalid base64"):
        data_url_reader("data:x;base64,AB!D")(3)


def _body(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, *parts]}]}


def _part(kind: str, data: bytes, mime: str = "application/octet-stream") -> dict:
    if kind == "input_audio":
        return {"type": kind, "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    return {"type": kind, kind: {"url": data_url(data, mime)}}


@pytest.mark.parametrize(
    ("part", "says"),
    [
        (_part("input_audio", CONCAT), "looks like an ffconcat playlist"),
        (_part("audio_url", CONCAT, "audio/wav"), "looks like an ffconcat playlist"),
        (_part("video_url", CONCAT, "video/mp4"), "looks like an ffconcat playlist"),
        (_part("video_url", PNG, "video/mp4"), "looks like a PNG image"),
        (_part("image_url", video_bytes(), "image/png"), "looks like an MP4/MOV file"),
        (_part("input_audio", MP3_SYNC + SDP), "SDP session description"),
    ],
)
def test_a_body_medium_an_engine_would_probe_is_a_400_naming_its_part(part: dict, says: str) -> None:
    good = [_part("image_url", PNG, "image/png"), _part("input_audio", WAV), _part("video_url", video_bytes())]
    assert len(collect_media(_body(*good), UrlPolicy(), max_items=8)) == 3
    with pytest.raises(ApiError) as caught:
        collect_media(_body(*good, part), UrlPolicy(), max_items=8)
    assert caught.value.status == 400 and caught.value.message.startswith("messages[0].content[4]: ")
    assert says in caught.value.message


def test_a_fetched_medium_is_checked_as_its_part_says(tmp_path: Path) -> None:
    (tmp_path / "secret.wav").write_bytes(WAV)
    (tmp_path / "list.wav").write_bytes(CONCAT)
    (tmp_path / "clip.wav").write_bytes(WAV)
    policy = UrlPolicy(file_roots=(tmp_path.resolve(),))

    def inline(*names_and_kinds: tuple[str, str]) -> dict | None:
        parts = [{"type": kind, kind: {"url": (tmp_path / name).resolve().as_uri()}} for name, kind in names_and_kinds]
        body = _body(*parts)

        async def go() -> dict | None:
            inliner = MediaInliner(policy, MediaLimits(), 1 << 20)
            try:
                return await inliner.inline(body, collect_media(body, policy, max_items=8), inliner.budget())
            finally:
                await inliner.aclose()

        return asyncio.run(go())

    assert inline(("clip.wav", "audio_url")) is not None
    for parts, where, says in (
        ([("clip.wav", "audio_url"), ("list.wav", "audio_url")], 2, "ffconcat playlist"),
        ([("clip.wav", "audio_url"), ("clip.wav", "video_url")], 2, "looks like a WAV file"),
    ):
        with pytest.raises(ApiError) as caught:
            inline(*parts)
        assert caught.value.status == 400 and f"messages[0].content[{where}]: " in caught.value.message
        assert says in caught.value.message


def test_the_gateway_answers_400_before_any_upstream() -> None:
    """The app itself, its upstream a closed port: the refusal comes before anything is sent on."""
    app = create_app(GatewayConfig(colocated_urls=("http://127.0.0.1:9",)))
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json=_body(_part("input_audio", CONCAT)))
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith("messages[0].content[1]: ") and "ffconcat playlist" in message
