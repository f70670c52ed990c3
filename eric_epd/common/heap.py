"""glibc's heap told to keep freed memory for reuse (mallopt), so a server handling bodies of megabytes does not
fault fresh pages in for every one: each process of a server calls `keep_freed_heap` once, at its start."""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
MMAP_THRESHOLD_MAX = 32 * 2**20
"""The largest mmap threshold glibc takes on a 64-bit host (DEFAULT_MMAP_THRESHOLD_MAX)."""
DEFAULT_KEEP_BYTES = 64 * 2**20
"""Freed memory a process keeps at its heap's top by default (--heap-keep-bytes)."""


def keep_freed_heap(keep_bytes: int) -> bool:
    """Keep up to `keep_bytes` of freed memory in this process's heap and serve allocations up to 32 MiB from it
    (glibc's M_TRIM_THRESHOLD and M_MMAP_THRESHOLD); False, leaving the allocator as it is, for 0 or an allocator
    without glibc's mallopt. By default glibc maps each allocation over 128 KiB afresh and returns freed memory at
    once until its adaptive thresholds catch up, so every request body, string and array of megabytes faulted its
    pages in again: on a resent 1024 px PNG (3.5 MB of data: URL), about half of Eric's CPU per item
    (benchmarks/eric_repeat.py)."""
    if keep_bytes <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no glibc mallopt here: the heap keeps the allocator's own defaults")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    keep = min(keep_bytes, 2**31 - 1)
    if not (mallopt(M_TRIM_THRESHOLD, keep) and mallopt(M_MMAP_THRESHOLD, min(keep, MMAP_THRESHOLD_MAX))):
        logger.warning("mallopt refused the heap settings: the heap keeps the allocator's own defaults")
        return False
    return True
