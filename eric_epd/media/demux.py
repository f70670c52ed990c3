"""Opens a client's bytes with PyAV under the demuxer `containers.sniff` chose, so FFmpeg never probes them, uses no
protocol and opens no other demuxer (`containers.demuxer_options`)."""

from __future__ import annotations

import io

import av
from av.container import InputContainer

from eric_epd.media.containers import demuxer_options


def open_input(data: bytes, demuxer: str) -> InputContainer:
    """`data` opened for reading with `demuxer` forced (one `containers.sniff` returned for it)."""
    return av.open(io.BytesIO(data), mode="r", format=demuxer, container_options=demuxer_options(demuxer),
                   metadata_errors="ignore")
