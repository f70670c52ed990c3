"""A fetched body's Content-Encoding undone within a bound: media is asked for with `Accept-Encoding: identity`; an
origin that compresses anyway may use one gzip or deflate layer, inflated to at most the per-item limit, never more."""

from __future__ import annotations

import zlib

from eric_epd.media.url_policy import MediaError

ACCEPT_ENCODING = "identity"
"""What the fetcher asks for: no compression (media formats compress themselves)."""
INFLATABLE = frozenset({"gzip", "x-gzip", "deflate"})
"""The one layer an origin may still send; anything else (br, zstd, compress) is refused."""


def content_layers(header: str) -> list[str]:
    """The Content-Encoding header's codings, outermost last as sent ("identity" dropped), lower-cased."""
    return [c for c in (part.strip().lower() for part in header.split(",")) if c and c != "identity"]


def check_layers(layers: list[str], shown: str) -> None:
    """400 unless the response carries at most one coding, and that one inflatable."""
    if len(layers) > 1:
        raise MediaError(
            400, f"{shown} is sent with {len(layers)} content encodings ({', '.join(layers)}); at most one is accepted"
        )
    if layers and layers[0] not in INFLATABLE:
        raise MediaError(
            400, f"{shown} is sent with content encoding {layers[0]!r}; only gzip or deflate (or none) is accepted"
        )


def inflate(data: bytes, coding: str, max_bytes: int, shown: str) -> bytes:
    """`data` inflated from `coding` (gzip or deflate, zlib-wrapped or raw), refused with a 413 once the output
    would pass `max_bytes` (never more than max_bytes + 1 bytes are produced) and a 400 if it is not that coding or
    holds more than one gzip member. CPU-bound: call it off the event loop."""
    if coding in ("gzip", "x-gzip"):
        return _inflate(data, zlib.decompressobj(16 + zlib.MAX_WBITS), max_bytes, shown, coding)
    try:
        return _inflate(data, zlib.decompressobj(zlib.MAX_WBITS), max_bytes, shown, coding)
    except MediaError as e:  # servers send raw deflate under this name too
        if e.status != 400:
            raise
        return _inflate(data, zlib.decompressobj(-zlib.MAX_WBITS), max_bytes, shown, coding)


def _inflate(data: bytes, inflater: zlib._Decompress, max_bytes: int, shown: str, coding: str) -> bytes:
    try:
        out = inflater.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise MediaError(400, f"{shown} is not valid {coding} data: {exc}") from exc
    if len(out) > max_bytes or inflater.unconsumed_tail:
        raise MediaError(413, f"{shown} inflates ({coding}) to over the size limit of {max_bytes} bytes")
    if not inflater.eof:
        raise MediaError(400, f"{shown} is truncated {coding} data")
    if inflater.unused_data:
        raise MediaError(400, f"{shown} holds data after its {coding} stream (more than one member); refused")
    return out
