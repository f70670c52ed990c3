"""Sweeps shared-memory segments whose creator died without unlinking them (SIGKILL, the OOM killer): each
server calls it at start, so a crash loop does not fill /dev/shm with dead pools and rings. `remove_unowned` is the
owner-lock test it (and runtime/run_dir.py's sweep) removes by."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable
from functools import partial

from eric_epd.common.shm import SHM_DIR

logger = logging.getLogger(__name__)

ORPHAN_AGE_S = 60.0
"""A segment younger than this is never swept: its creator may not have taken its lock yet."""


def sweep_orphans(prefixes: tuple[str, ...], min_age_s: float = ORPHAN_AGE_S, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments named with one of `prefixes`, older than `min_age_s`, that no live creator holds (its
    flock, common/shm.Segment) and that no process this one can see still maps; returns their names. Another
    user's segments (unreadable) and a live owner's (locked) are left alone."""
    if not os.path.isdir(shm_dir):
        return []
    now, candidates = time.time(), []
    for entry in os.scandir(shm_dir):
        if not entry.name.startswith(prefixes):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and now - st.st_ctime >= min_age_s:
            candidates.append(entry)
    if not candidates:
        return []
    mapped = _mapped_paths()
    unlinked = (e for e in candidates if e.path not in mapped and remove_unowned(e.path, partial(os.unlink, e.path)))
    swept = [e.name for e in unlinked]
    if swept:
        logger.warning("removed %d shared-memory segments left by dead processes: %s", len(swept), ", ".join(swept))
    return swept


def remove_unowned(lock: str, remove: Callable[[], object], born_before: float | None = None) -> bool:
    """Run `remove()` if no process holds the owner flock on file `lock` (and, with `born_before`, the lock file was
    last touched before then), holding that flock exclusively meanwhile; whether it removed. A missing lock, another
    user's, a live owner's or a failed removal: False."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # gone already, never locked (an older release), or another user's
        return False
    try:
        if born_before is not None and os.fstat(fd).st_mtime >= born_before:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: its owner lives
        remove()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _mapped_paths() -> set[str]:
    """The files every process this one may read /proc of has mapped (a segment of a creator that took no lock, an
    older release's, is left while anyone maps it)."""
    paths: set[str] = set()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    at = line.find("/")
                    if at >= 0:
                        paths.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue
    return paths
