"""Which container a client's medium is, told from its leading bytes in pure Python against an allowlist per modality:
Eric opens it with that demuxer forced (FFmpeg never probes), and the gateway passes an engine only such media.

Probing is the danger: FFmpeg would take `ffconcat version 1.0\\nfile secret.wav` for a concat playlist and read the
named file from the process's working directory; HLS, DASH, SDP, image2 and the like open other files or URLs too."""

from __future__ import annotations

from eric_epd.media.url_policy import MediaError

SNIFF_BYTES = 4096
"""How much of a medium the sniff reads (past any ID3 tag)."""

IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "PPM", "ICO", "AVIF")
"""PIL formats Eric decodes and the gateway passes; excludes e.g. EPS (runs Ghostscript) and exotic plugins."""
VIDEO_DEMUXERS = ("mov", "matroska", "avi", "mpegts", "mpeg", "flv", "ogg")
"""FFmpeg demuxers a video may be opened with: none of them opens another file or URL (mov's external data
references stay off, see `demuxer_options`)."""
AUDIO_DEMUXERS = ("wav", "w64", "aiff", "caf", "au", "flac", "mp3", "aac", *VIDEO_DEMUXERS)
"""FFmpeg demuxers an audio item may be opened with: the audio containers and the video ones (an m4a or a webm is
audio in a video container, and a video's soundtrack is decoded from the video)."""
ALLOWED = {"image": IMAGE_FORMATS, "video": VIDEO_DEMUXERS, "audio": AUDIO_DEMUXERS}
SEND = {
    "image": "png, jpeg, gif, webp, bmp, tiff, ppm, ico or avif",
    "video": "mp4, mov, webm, mkv, avi, mpeg-ts, mpeg-ps, flv or ogg",
    "audio": "wav, flac, mp3, aac, m4a, ogg, webm, aiff, caf or au",
}
"""What a refusal tells the client to send instead, by modality."""

NO_PROTOCOL = "none"
"""A protocol whitelist naming no FFmpeg protocol: the bytes come from memory, so a demuxer needs none, and any
nested open (a playlist's entry, a reference) fails."""

_PREFIXES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),
    (b"MM\x00+", "TIFF"),
    (b"BM", "BMP"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x1a\x45\xdf\xa3", "matroska"),
    (b"FLV\x01", "flv"),
    (b"OggS", "ogg"),
    (b"\x00\x00\x01\xba", "mpeg"),
    (b"fLaC", "flac"),
    (b"caff", "caf"),
    (b".snd", "au"),
    (b"riff\x2e\x91\xcf\x11\xa5\xd6\x28\xdb\x04\xc1\x00\x00", "w64"),
)
"""(magic at offset 0, name): FFmpeg demuxers in lower case, PIL formats in upper case."""
_RIFF = (b"RIFF", b"RIFX", b"RF64", b"BW64")
_RIFF_FORMS = {b"WAVE": "wav", b"AVI ": "avi", b"WEBP": "WEBP"}
_AIFF_FORMS = (b"AIFF", b"AIFC")
_ISO_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")
"""ISO BMFF / QuickTime top-level boxes a file starts with (the box type at offset 4)."""
_AVIF_BRANDS = (b"avif", b"avis", b"mif1", b"msf1")
_HEIF_BRANDS = (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs")

LABELS = {
    "mov": "an MP4/MOV file",
    "matroska": "a Matroska/WebM file",
    "avi": "an AVI file",
    "mpegts": "an MPEG-TS stream",
    "mpeg": "an MPEG-PS stream",
    "flv": "an FLV file",
    "ogg": "an Ogg file",
    "wav": "a WAV file",
    "w64": "a Wave64 file",
    "aiff": "an AIFF file",
    "caf": "a CAF file",
    "au": "an AU file",
    "flac": "a FLAC file",
    "mp3": "an MP3 stream",
    "aac": "an ADTS AAC stream",
    "HEIF": "a HEIF image",
    **{name: f"a {name} image" for name in IMAGE_FORMATS},
}
_LOOKALIKES = (
    (b"ffconcat", "an ffconcat playlist"),
    (b"#EXTM3U", "an HLS (m3u8) playlist"),
    (b"<MPD", "a DASH manifest"),
    (b"<?xml", "an XML document"),
    (b"v=0", "an SDP session description"),
    (b"%!PS", "PostScript"),
    (b"#!", "a script"),
)
"""Text the refusal names: playlists and descriptions FFmpeg would follow, and other things sent for media."""


def sniff(data: bytes, modality: str) -> str:
    """The name to open `data` with: the FFmpeg demuxer to force (audio, video) or the PIL format (image). 400 naming
    what it looks like when its leading bytes are no container `modality` allows."""
    found = identify(data[: id3_length(data) + SNIFF_BYTES])
    if found in ALLOWED[modality]:
        return found
    kind = "format" if modality == "image" else "container"
    raise MediaError(
        400, f"not a supported {modality} {kind} (it looks like {describe(data, found)}); send {SEND[modality]}"
    )


def id3_length(head: bytes) -> int:
    """The length of the ID3v2 tag `head` starts with (FFmpeg skips it when probing; MP3, AAC and FLAC follow it),
    0 if none."""
    if not head.startswith(b"ID3") or len(head) < 10:
        return 0
    return 10 + (head[6] << 21 | head[7] << 14 | head[8] << 7 | head[9]) + (10 if head[5] & 0x10 else 0)


def identify(head: bytes) -> str | None:
    """The FFmpeg demuxer (lower case) or PIL format (upper case) whose magic `head` starts with; None if none."""
    skip = id3_length(head)
    if skip:
        after = head[skip:]
        return "flac" if after.startswith(b"fLaC") else _frame_sync(after)
    if head[4:8] in _ISO_BOXES:  # before the short magics: a box's size (offset 0) may look like ICO's or MPEG-PS's
        return _iso_brand(head)
    for magic, name in _PREFIXES:
        if head.startswith(magic):
            return name
    if head[:4] in _RIFF and len(head) >= 12:
        return _RIFF_FORMS.get(head[8:12])
    if head.startswith(b"FORM") and head[8:12] in _AIFF_FORMS:
        return "aiff"
    if head[:1] == b"P" and len(head) >= 2 and head[1] in b"0123456fy":
        return "PPM"
    if _is_transport_stream(head):
        return "mpegts"
    return _frame_sync(head)


def _iso_brand(head: bytes) -> str:
    """An ISO BMFF file by its major brand: an AVIF or HEIF image, else a video or audio file for FFmpeg's mov."""
    if head[4:8] == b"ftyp" and head[8:12] in _AVIF_BRANDS:
        return "AVIF"
    if head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS:
        return "HEIF"
    return "mov"


def _is_transport_stream(head: bytes) -> bool:
    """MPEG-TS: the 0x47 sync byte starting two packets running (188 bytes each; M2TS: 192, a 4-byte time first)."""
    return any(
        len(head) > start + size and head[start] == head[start + size] == 0x47 for start, size in ((0, 188), (4, 192))
    )


def _frame_sync(head: bytes) -> str | None:
    """ADTS AAC (12 sync bits, layer 00) or an MPEG audio frame (11 sync bits, a version and a layer that exist)."""
    if len(head) < 2 or head[0] != 0xFF:
        return None
    if head[1] & 0xF6 == 0xF0:
        return "aac"
    version, layer = head[1] >> 3 & 3, head[1] >> 1 & 3
    return "mp3" if head[1] & 0xE0 == 0xE0 and version != 1 and layer != 0 else None


def describe(data: bytes, found: str | None) -> str:
    """What a refused medium looks like, for the client: a known format, a playlist FFmpeg would follow, text."""
    if found is not None:
        return LABELS[found]
    head = data[:SNIFF_BYTES].lstrip(b"\xef\xbb\xbf \t\r\n")
    for magic, label in _LOOKALIKES:
        if head.startswith(magic):
            return label
    if not head:
        return "nothing (no bytes)"
    sample = head[:512]
    printable = sum(32 <= b < 127 or b in b"\t\r\n" for b in sample)
    return "text" if printable == len(sample) else "no format Eric knows"


def demuxer_options(demuxer: str) -> dict[str, str]:
    """`container_options` for opening client bytes from memory with `demuxer` forced: no protocol and no other
    demuxer, which FFmpeg checks on every nested open too (concat, HLS and DASH copy both to what they open), and the
    mov demuxer's external data references (drefs) off. PyAV 18 hands these to `avformat_open_input`: an option the
    demuxer lacks is silently left unused, a bad value for one it has is refused (the tests check `enable_drefs`)."""
    options = {"protocol_whitelist": NO_PROTOCOL, "format_whitelist": demuxer}
    if demuxer == "mov":
        options["enable_drefs"] = "0"  # FFmpeg's default, said here so no build or default change turns them on
    return options
