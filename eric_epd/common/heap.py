"""glibc's heap told to keep freed memory for reuse (mallopt), so a server handling bodies of megabytes does not
fault fresh pages in for every one: each process of a server calls `keep_freed_heap` once, at its start."""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
MMAP_THRESHOLD_MAX = 4 * 2**20 * ctypes.sizeof(ctypes.c_long)
"""The largest mmap threshold glibc takes (DEFAULT_MMAP_THRESHOLD_MAX: 32 MiB on a 64-bit host)."""
MIN_KEEP_BYTES = 2**20
"""The least --heap-keep-bytes other than 0 (below it every heap extension would be mapped and trimmed again)."""
DEFAULT_KEEP_BYTES = 64 * 2**20
"""Freed memory each malloc arena of a process keeps by default (--heap-keep-bytes)."""


def check_keep_bytes(keep_bytes: int) -> None:
    """Refuse a keep other than 0 (glibc's defaults) or at least MIN_KEEP_BYTES."""
    if keep_bytes != 0 and keep_bytes < MIN_KEEP_BYTES:
        raise ValueError(f"heap_keep_bytes must be 0 (glibc's defaults) or at least {MIN_KEEP_BYTES}, got {keep_bytes}")


def keep_freed_heap(keep_bytes: int) -> bool:
    """Keep up to `keep_bytes` of freed memory at the top of each of this process's malloc arenas and serve
    allocations up to min(keep_bytes, 32 MiB) from them (glibc's M_MMAP_THRESHOLD, then M_TRIM_THRESHOLD); False,
    leaving the allocator as it is, for 0 or an allocator without glibc's mallopt. By default glibc maps each
    allocation over 128 KiB afresh and returns freed memory at once until its adaptive thresholds catch up, so every
    request body, string and array of megabytes faulted its pages in again: on a resent 1024 px PNG (3.5 MB of data:
    URL), about half of Eric's CPU per item (benchmarks/eric_repeat.py). A process keeps up to `keep_bytes` per
    arena (glibc makes arenas for threads that allocate at once, up to 8 per core)."""
    if keep_bytes <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no glibc mallopt here: the heap keeps the allocator's own defaults")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: glibc refuses only values over its maximum (never asked for here), and a refusal
    # changes nothing, where a trim threshold set alone would freeze the mmap threshold at 128 KiB
    if not mallopt(M_MMAP_THRESHOLD, min(keep_bytes, MMAP_THRESHOLD_MAX)):
        logger.warning("mallopt refused the mmap threshold: the heap keeps the allocator's own defaults")
        return False
    if not mallopt(M_TRIM_THRESHOLD, min(keep_bytes, 2**31 - 1)):
        logger.warning("mallopt refused the trim threshold: freed memory is still returned at once")
        return False
    return True
