"""Client media never make FFmpeg read the server's own files: the container is told from the bytes' leading magic
against an allowlist per modality and forced on FFmpeg (media/containers.py), so an ffconcat or HLS playlist, an SDP
description or a still image sent as audio or video is a 400, while every container the project writes still
decodes to its values. Each attack is first shown to work against a probing `av.open` in this environment."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile
from PIL import Image

from eric_epd.eric.decode import decode_image, decode_video
from eric_epd.media.audio import decode_audio
from eric_epd.media.containers import AUDIO_DEMUXERS, IMAGE_FORMATS, VIDEO_DEMUXERS, identify, sniff
from eric_epd.media.demux import open_input
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError
from eric_epd.testing.media import audio_bytes, audio_samples, random_image, video_bytes

RATE = 16000
SECRET = (np.sin(np.arange(RATE // 2) / 7.0) * 0.25).astype(np.float32)
"""The server's own audio file: float samples, so even vLLM's float-only PyAV path would take them as audio."""
CONCAT = b"ffconcat version 1.0\nfile secret.wav\n"
HLS = b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nsecret.wav\n#EXT-X-ENDLIST\n"
SDP = b"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
"""An SDP description without media lines: FFmpeg takes it for SDP but opens no socket."""
COLORS = [(230, 20, 20), (20, 230, 20), (20, 20, 230), (230, 230, 20), (20, 230, 230), (230, 20, 230)]


def _refused(decode: object, data: bytes, *says: str) -> MediaError:
    with pytest.raises(MediaError) as caught:
        decode(data, MediaLimits())  # type: ignore[operator]
    assert caught.value.status == 400
    for text in says:
        assert text in caught.value.message, caught.value.message
    return caught.value


@pytest.fixture
def secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding a WAV and an MP4 of the server's own."""
    soundfile.write(tmp_path / "secret.wav", SECRET, RATE, subtype="FLOAT")
    (tmp_path / "secret.mp4").write_bytes(video_bytes(num_frames=4, seed=9))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_an_ffconcat_playlist_is_refused_and_the_secret_never_decoded(secrets: Path) -> None:
    with av.open(io.BytesIO(CONCAT)) as probed:  # the attack is real here: a probing open reads the file
        assert probed.format.name == "concat"
        read = np.concatenate([frame.to_ndarray()[0] for frame in probed.decode(audio=0)])
    np.testing.assert_array_equal(read, SECRET)
    _refused(decode_audio, CONCAT, "could not decode audio", "looks like an ffconcat playlist", "send wav")
    video = CONCAT.replace(b"secret.wav", b"secret.mp4")
    with av.open(io.BytesIO(video)) as probed:
        assert sum(1 for _ in probed.decode(video=0)) == 4
    _refused(decode_video, video, "could not decode video", "looks like an ffconcat playlist", "send mp4")


def test_the_open_options_alone_stop_a_demuxer_opening_another_file(secrets: Path) -> None:
    """Were concat ever forced, the options every open carries (no protocol, no other demuxer) stop its nested
    open: the second wall behind the allowlist."""
    with av.open(io.BytesIO(CONCAT), format="concat") as forced:
        assert sum(frame.samples for frame in forced.decode(audio=0)) == SECRET.size
    with pytest.raises(av.FFmpegError, match="Invalid argument"):
        open_input(CONCAT, "concat")
    with pytest.raises(av.FFmpegError):  # mov's dref option is real: a bad value is refused, not ignored
        av.open(io.BytesIO(video_bytes()), format="mov", container_options={"enable_drefs": "maybe"})


def test_playlists_descriptions_and_stills_are_refused(secrets: Path) -> None:
    for decode, modality in ((decode_audio, "audio"), (decode_video, "video")):
        _refused(decode, HLS, f"could not decode {modality}", "HLS (m3u8) playlist")
        _refused(decode, HLS.replace(b"secret.wav", (secrets / "secret.wav").as_uri().encode()), "HLS")
        _refused(decode, SDP, "SDP session description")
        _refused(decode, b"<?xml version='1.0'?><MPD/>", "an XML document")
        _refused(decode, b"just some words\n" * 4, "it looks like text")
    with av.open(io.BytesIO(SDP)) as probed:
        assert probed.format.name == "sdp"
    png = _image("PNG")
    with av.open(io.BytesIO(png)) as probed:  # FFmpeg opens a lone still image as a one-frame "video"
        assert probed.format.name == "png_pipe" and probed.streams.video
    _refused(decode_video, png, "could not decode video", "looks like a PNG image")
    _refused(decode_video, _image("JPEG"), "looks like a JPEG image")
    _refused(decode_video, audio_bytes(RATE // 4, RATE), "looks like a WAV file")
    _refused(decode_audio, png, "could not decode audio", "looks like a PNG image")


def test_the_sniff_names_each_allowlisted_container() -> None:
    assert set(VIDEO_DEMUXERS) <= set(AUDIO_DEMUXERS)  # a video's soundtrack is decoded from the video
    for name in (*AUDIO_DEMUXERS, *VIDEO_DEMUXERS):
        assert av.ContainerFormat(name, "r").is_input  # each is a demuxer of this FFmpeg
    ts = b"".join(b"\x47" + bytes(187) for _ in range(3))
    m2ts = b"".join(bytes(4) + b"\x47" + bytes(187) for _ in range(3))  # a 4-byte time before each packet
    assert identify(ts) == identify(m2ts) == "mpegts" and identify(ts[:188]) is None
    assert identify(b"\xff\xf1\x50\x80") == "aac" and identify(b"\xff\xfb\x90\x64") == "mp3"
    assert identify(b"\xff\xd8\xff\xe0") == "JPEG" and identify(b"\xff\x00") is None
    id3 = b"ID3\x04\x00\x00\x00\x00\x01\x00" + bytes(128)
    assert identify(id3 + b"\xff\xfb\x90\x64") == "mp3" and identify(id3 + b"fLaC") == "flac"
    assert identify(id3 + CONCAT) is None  # FFmpeg's probe skips an ID3 tag: what follows must be audio too
    assert identify(b"\x00\x00\x01\x00mdat") == "mov" and identify(b"\x00\x00\x01\x00\x01\x00") == "ICO"
    assert sniff(b"\x00\x00\x00\x1cftypavif" + bytes(16), "image") == "AVIF"
    with pytest.raises(MediaError, match="looks like a HEIF image"):
        sniff(b"\x00\x00\x00\x1cftypheic" + bytes(16), "video")


# ---------------------------------------------------------------- what the project sends still decodes


def _tone_hz(samples: np.ndarray, rate: int) -> float:
    return float(np.argmax(np.abs(np.fft.rfft(samples))) * rate / samples.size)


def _pyav_audio(container: str, codec: str, sample_format: str = "fltp") -> bytes:
    """Half a second of `audio_samples` (a 220 Hz tone) encoded by FFmpeg."""
    samples = audio_samples(RATE // 2, RATE).T.copy()
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples, format=sample_format, layout="mono")
        frame.sample_rate = RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3", "aiff", "caf", "au", "w64"])
def test_audio_libsndfile_writes_still_decodes(fmt: str) -> None:
    if fmt in ("wav", "flac", "ogg", "mp3"):
        data = audio_bytes(RATE // 2, RATE, 1, fmt)
    else:
        buf = io.BytesIO()
        soundfile.write(buf, audio_samples(RATE // 2, RATE), RATE, format=fmt.upper(), subtype="PCM_16")
        data = buf.getvalue()
    assert sniff(data, "audio") == fmt
    decoded = decode_audio(data, MediaLimits())
    assert decoded.sample_rate == RATE and abs(decoded.samples.size - RATE // 2) < RATE // 10
    assert abs(_tone_hz(decoded.samples, RATE) - 220) < 5
    if fmt not in ("ogg", "mp3"):  # lossless: the written samples within 16-bit quantization
        assert np.abs(decoded.samples - audio_samples(RATE // 2, RATE)[:, 0]).max() <= 2.0**-15


@pytest.mark.parametrize(
    ("container", "codec", "sample_format", "demuxer"),
    [
        ("adts", "aac", "fltp", "aac"),
        ("ipod", "aac", "fltp", "mov"),
        ("webm", "libopus", "flt", "matroska"),
        ("matroska", "pcm_f32le", "flt", "matroska"),
        ("mp3", "libmp3lame", "fltp", "mp3"),
    ],
)
def test_audio_ffmpeg_writes_still_decodes(container: str, codec: str, sample_format: str, demuxer: str) -> None:
    data = _pyav_audio(container, codec, sample_format)
    assert sniff(data, "audio") == demuxer
    decoded = decode_audio(data, MediaLimits())
    assert decoded.sample_rate in (RATE, 48000) and decoded.channels == 1
    seconds = decoded.samples.size / decoded.sample_rate
    assert 0.45 < seconds < 0.65 and abs(_tone_hz(decoded.samples, decoded.sample_rate) - 220) < 5
    if codec == "pcm_f32le":
        np.testing.assert_array_equal(decoded.samples, audio_samples(RATE // 2, RATE)[:, 0])


def _solid_video(container: str, codec: str, fps: int = 4) -> bytes:
    """One second of solid COLORS frames, one colour a frame."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(fps):
            rgb = np.full((32, 32, 3), COLORS[i], dtype=np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


@pytest.mark.parametrize(
    ("container", "codec", "demuxer"),
    [
        ("mp4", "mpeg4", "mov"),
        ("mov", "mpeg4", "mov"),
        ("matroska", "mpeg4", "matroska"),
        ("webm", "libvpx", "matroska"),
        ("avi", "mpeg4", "avi"),
        ("mpegts", "mpeg2video", "mpegts"),
        ("mpeg", "mpeg2video", "mpeg"),
        ("flv", "flv", "flv"),
    ],
)
def test_video_containers_still_decode(container: str, codec: str, demuxer: str) -> None:
    data = _solid_video(container, codec)
    assert sniff(data, "video") == demuxer
    frames, _, _ = decode_video(data, MediaLimits(video_fps=4.0))
    assert frames.shape == (4, 32, 32, 3)
    np.testing.assert_allclose(frames.reshape(4, -1, 3).mean(axis=1), np.asarray(COLORS[:4], float), atol=12)
    project, _, _ = decode_video(video_bytes(num_frames=8, fps=4), MediaLimits(video_fps=4.0))
    assert project.shape == (8, 48, 64, 3)


def _image(fmt: str) -> bytes:
    buf = io.BytesIO()
    random_image(16, 16, seed=5).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", IMAGE_FORMATS)
def test_images_still_decode(fmt: str) -> None:
    Image.init()
    if fmt not in Image.OPEN:
        pytest.skip(f"this Pillow reads no {fmt}")
    data = _image(fmt)
    assert sniff(data, "image") == fmt
    image = decode_image(data, MediaLimits())
    assert image.size == (16, 16) and image.mode == "RGB"
    if fmt in ("PNG", "BMP", "TIFF", "PPM", "ICO"):
        np.testing.assert_array_equal(np.asarray(image), np.asarray(random_image(16, 16, seed=5)))
