"""Opens a client's bytes with PyAV under the demuxer `containers.sniff` chose, so FFmpeg never probes them, uses no
protocol and opens no other demuxer (`containers.demuxer_options`); and, for the decoders, the same steps with every
refusal as a 400 "could not decode <modality>: ..."."""

from __future__ import annotations

import io
from collections.abc import Mapping
from types import MappingProxyType

import av
from av.container import InputContainer

from eric_epd.media.containers import demuxer_options, sniff
from eric_epd.media.url_policy import MediaError

OPEN_FAILURES: Mapping[str, str] = MappingProxyType({"video": "{exc}", "audio": "unrecognised or corrupt data ({exc})"})
"""How a decoder's refusal words FFmpeg's error on opening the container, by modality."""


def open_input(data: bytes, demuxer: str) -> InputContainer:
    """`data` opened for reading with `demuxer` forced (one `containers.sniff` returned for it)."""
    return av.open(
        io.BytesIO(data), mode="r", format=demuxer, container_options=demuxer_options(demuxer), metadata_errors="ignore"
    )


def sniff_for_decoding(data: bytes, modality: str) -> str:
    """`containers.sniff`'s demuxer for `data`; its refusal as a 400 "could not decode <modality>: ..."."""
    try:
        return sniff(data, modality)
    except MediaError as exc:
        raise MediaError(400, f"could not decode {modality}: {exc.message}") from exc


def open_for_decoding(data: bytes, demuxer: str, modality: str) -> InputContainer:
    """`open_input`, any error it raises as a 400 "could not decode <modality>: ..." (FFmpeg's worded as
    `OPEN_FAILURES` says)."""
    try:
        return open_input(data, demuxer)
    except av.FFmpegError as exc:
        raise MediaError(400, f"could not decode {modality}: {OPEN_FAILURES[modality].format(exc=exc)}") from exc
    except Exception as exc:
        raise MediaError(400, f"could not decode {modality}: {str(exc) or type(exc).__name__}") from exc
